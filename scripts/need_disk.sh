#!/usr/bin/env bash
# need_disk.sh GB WHAT SKIP_VAR [DIR]: exit 0 when the file system of DIR (default: the current directory) has
# at least GB GiB free; else one clear line on stderr (what needs the space, how much is free, which variable
# skips the step) and exit 2. Called before a virtual environment of several GB is created, so that a full disk
# reads as that and not as pip's "[Errno 28] No space left on device" half-way through an install. When df
# cannot tell, it says nothing and exits 0 (the install then says what is wrong).
set -uo pipefail
need_gb=$1
what=$2
skip=${3:-}
dir=${4:-.}
free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 { print $4 }')
[[ "$free_kb" =~ ^[0-9]+$ ]] || exit 0
if (( free_kb < need_gb * 1024 * 1024 )); then
  hint=""
  [ -n "$skip" ] && hint="; $skip=1 skips this step"
  echo "not enough free disk for $what: $((free_kb / 1024 / 1024)) GiB free under $(cd "$dir" && pwd), about $need_gb GiB needed$hint" >&2
  exit 2
fi
