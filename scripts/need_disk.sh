#!/usr/bin/env bash
# need_disk.sh GB WHAT SKIP_VAR: exit 0 when the file system of the current directory has at least GB GiB free;
# else one clear line (what needs the space, how much is free, which variable skips the step) and exit 2.
# Called before a virtual environment of several GB is created, so that a full disk reads as that and not as
# pip's "[Errno 28] No space left on device" half-way through an install.
set -euo pipefail
need_gb=$1
what=$2
skip=${3:-}
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ -z "$free_kb" ]; then
  exit 0  # (df could not tell: let the install say what is wrong)
fi
if (( free_kb < need_gb * 1024 * 1024 )); then
  hint=""
  [ -n "$skip" ] && hint="; $skip=1 skips this step"
  echo "not enough free disk for $what: $((free_kb / 1024 / 1024)) GiB free under $PWD, about $need_gb GiB needed$hint" >&2
  exit 2
fi
