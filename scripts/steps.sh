# Sourced by scripts/test.sh and scripts/test_vllm.sh: say what each step does and keep saying it while it runs.
#   step "what" cmd...       prints "== what" and runs cmd with its output shown (for tools that report
#                            their own progress: pytest, ruff)
#   quiet_step "what" cmd... prints "== what", hides cmd's output unless it fails (then its last 40 lines)
#                            and prints a line every $KVRETAIN_HEARTBEAT_S seconds (default 30) while it runs
# Both return cmd's exit status (a failing quiet_step also says which command failed).

_heartbeat() {  # _heartbeat PID WHAT: a line every KVRETAIN_HEARTBEAT_S seconds until PID exits
  local pid=$1 what=$2 every=${KVRETAIN_HEARTBEAT_S:-30} waited=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
    if (( waited % every == 0 )) && kill -0 "$pid" 2>/dev/null; then
      echo "   ... still $what (${waited} s)"
    fi
  done
}

_run_with_heartbeat() {  # _run_with_heartbeat WHAT LOG cmd...: cmd's output to LOG
  local what=$1 log=$2 rc=0 pid hb
  shift 2
  "$@" >"$log" 2>&1 &
  pid=$!
  _heartbeat "$pid" "$what" &
  hb=$!
  wait "$pid" || rc=$?
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  return "$rc"
}

step() {
  local what=$1 start=$SECONDS rc=0
  shift
  echo "== $what"
  "$@" || rc=$?
  if (( SECONDS - start >= 30 )); then echo "   ($what: $((SECONDS - start)) s)"; fi
  return "$rc"
}

quiet_step() {
  local what=$1 start=$SECONDS rc=0 log
  shift
  log=$(mktemp)
  echo "== $what"
  _run_with_heartbeat "$what" "$log" "$@" || rc=$?
  if [ "$rc" != 0 ]; then
    tail -n 40 "$log"
    echo "failed ($rc): $*" >&2
  elif (( SECONDS - start >= 30 )); then
    echo "   done in $((SECONDS - start)) s"
  fi
  rm -f "$log"
  return "$rc"
}
