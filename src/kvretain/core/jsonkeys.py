"""JSON objects that name each key once: the ``object_pairs_hook`` for ``json.loads`` wherever kvretain reads a
document someone wrote (a trace line, the plugin's access limits). The standard parser keeps the last of a
repeated key without a word, so a second ``"priority"`` in a trace line, or a second ``"keys": []`` in the
access limits (which opened the server), would quietly override the first."""

from __future__ import annotations

from typing import Any


class DuplicateKeyError(ValueError):
    """An object names ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} is given twice in one object")
        self.key = key


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads(..., object_pairs_hook=unique_pairs)``: the object, or :class:`DuplicateKeyError`."""
    obj: dict[str, Any] = {}
    for k, v in pairs:
        if k in obj:
            raise DuplicateKeyError(k)
        obj[k] = v
    return obj
