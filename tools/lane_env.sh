# shellcheck shell=bash
# Sourced by tools/setup_lane.sh, tools/test.sh, tools/demo.sh and .buildkite/scripts/lane_exec.sh.
#   lane_venv LANE         prints the path of LANE's cached venv:
#                          ${MINICPMO_CG_CACHE:-~/.cache/minicpmo-cg}/venv-LANE-pyX.Y-<sha256 of lanes/LANE.txt + X.Y>
#   lock_lane_venv VENV    holds VENV's lock (flock on VENV.lock, fd 9) until the calling shell and
#                          every process it starts have exited, or until unlock_lane_venv
#   unlock_lane_venv       releases it (tools/test.sh all, between lanes)
# A venv is shared by every checkout on the machine and each run re-points its editable install
# and re-applies its patch set, so a run holds the lock from setup to its last test. A second run
# prints "waiting for the lock of venv ..." with the holder and waits; MINICPMO_CG_LOCK_TIMEOUT=S
# gives up after S seconds (exit 75). The scripts called by a holder see MINICPMO_CG_VENV_LOCKED=VENV
# and take no lock of their own.
lane_env_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

lane_venv() {
  local lane="$1" pins="$lane_env_root/lanes/$1.txt" py="${PYTHON:-python3}" pyver key
  pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || return 2
  key="$( (cat "$pins"; echo "$pyver") | sha256sum | cut -c1-12)"
  echo "${MINICPMO_CG_CACHE:-$HOME/.cache/minicpmo-cg}/venv-$lane-py$pyver-$key"
}

lock_lane_venv() {
  local venv="$1" lock="$1.lock" holder
  [ "${MINICPMO_CG_VENV_LOCKED:-}" = "$venv" ] && return 0
  if ! command -v flock >/dev/null 2>&1; then
    echo "lane lock: flock (util-linux) not found: $venv is used without a lock" >&2
    return 0
  fi
  mkdir -p "$(dirname "$venv")" || return 2
  exec 9>>"$lock" || return 2
  if ! flock -n 9; then
    holder="$(cat "$lock" 2>/dev/null)"
    echo "waiting for the lock of venv $venv held by another run (${holder:-holder unknown})" >&2
    if ! flock ${MINICPMO_CG_LOCK_TIMEOUT:+-w "$MINICPMO_CG_LOCK_TIMEOUT"} 9; then
      echo "gave up waiting for the lock of venv $venv after ${MINICPMO_CG_LOCK_TIMEOUT} s (MINICPMO_CG_LOCK_TIMEOUT)" >&2
      exec 9>&-
      return 75
    fi
  fi
  echo "pid $$, checkout $lane_env_root, since $(date '+%F %T')" > "$lock"
  lane_lock_held=1
  export MINICPMO_CG_VENV_LOCKED="$venv"
}

unlock_lane_venv() {
  [ -n "${lane_lock_held:-}" ] || return 0  # a lock this shell inherited is its caller's to release
  flock -u 9 2>/dev/null
  exec 9>&-
  lane_lock_held=
  unset MINICPMO_CG_VENV_LOCKED
}
