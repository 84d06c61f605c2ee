"""``python -m kvretain`` and the ``kvretain`` console script (``run``)."""

from __future__ import annotations

import sys


def run() -> int:
    """The command line, with a Ctrl-C while its modules load handled as at any other moment (one line, 130)."""
    try:
        from kvretain.cli import main
    except KeyboardInterrupt:  # (the import takes ~0.1 s: a Ctrl-C in it printed the import's traceback)
        print("kvretain: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
