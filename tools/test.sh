#!/usr/bin/env bash
# Run the test suite on one pinned lane, or on every lane.
#   usage: tools/test.sh {LANE|all} [pytest args...]        (LANE: a lanes/LANE.txt, e.g. current)
# For each lane: build/reuse its cached venv (tools/setup_lane.sh), apply the patch set to the
# installed vLLM/vllm-omni (minicpmo-cg-patch apply: idempotent), print the patch status, run pytest.
# CUDA tests skip with a reason on machines without a GPU; run them on a GPU host (offline:
# python -m minicpmo_cg.offline_gpu run). `all` runs the lanes in the sorted order of their file
# names (current, then legacy), so the legacy lane's differential test can compare against the
# outputs the current lane saved in $MINICPMO_CG_DIFF_DIR. Each lane's venv is locked from its setup
# to the end of its pytest (tools/lane_env.sh); a run of another checkout waits, saying so.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
which="${1:-}"; shift || true
all_lanes=()
for pins in "$root"/lanes/*.txt; do all_lanes+=("$(basename "$pins" .txt)"); done
if [ "$which" = all ]; then
  lanes=("${all_lanes[@]}")
elif [ -n "$which" ] && [ -f "$root/lanes/$which.txt" ]; then
  lanes=("$which")
else
  echo "usage: tools/test.sh {LANE|all} [pytest args...]; lanes: ${all_lanes[*]}" >&2; exit 2
fi
cleanup=()
if [ -z "${MINICPMO_CG_DIFF_DIR:-}" ]; then
  MINICPMO_CG_DIFF_DIR="$(mktemp -d -t minicpmo-cg-diff.XXXXXX)"
  cleanup+=("$MINICPMO_CG_DIFF_DIR")
fi
export MINICPMO_CG_DIFF_DIR
# pytest gets a TMPDIR of its own per lane, removed after a passing run (kept, and named, after a
# failing one); tests/conftest.py fails a session that leaves anything but pytest's basetemp there
run_tmp="$(mktemp -d -t minicpmo-cg-run.XXXXXX)"
trap 'rm -rf ${cleanup[@]+"${cleanup[@]}"}; rmdir "$run_tmp" 2>/dev/null || true' EXIT
cd "$root"
# shellcheck source=tools/lane_env.sh
source "$root/tools/lane_env.sh"
status=0
for lane in "${lanes[@]}"; do
  start=$SECONDS
  echo "=== lane $lane: setup" >&2
  # setup, apply and pytest under the venv's lock: another checkout's run cannot re-point it meanwhile
  venv="$(lane_venv "$lane")" && lock_lane_venv "$venv" || { echo "lane $lane: no lock of its venv" >&2; status=1; continue; }
  if ! bash tools/setup_lane.sh "$lane" >/dev/null; then
    echo "lane $lane: setup failed" >&2; status=1; unlock_lane_venv; continue
  fi
  if ! "$venv/bin/minicpmo-cg-patch" apply; then
    echo "lane $lane: minicpmo-cg-patch apply failed" >&2; status=1; unlock_lane_venv; continue
  fi
  "$venv/bin/minicpmo-cg-patch" status || true
  echo "=== lane $lane: pytest $*" >&2
  lane_tmp="$run_tmp/$lane"
  mkdir -p "$lane_tmp"
  TMPDIR="$lane_tmp" MINICPMO_CG_RUN_TMPDIR="$lane_tmp" "$venv/bin/python" -m pytest tests -p no:cacheprovider "$@"
  rc=$?
  unlock_lane_venv
  if [ $rc -eq 0 ]; then rm -rf "$lane_tmp"; else echo "lane $lane: its temporary files are kept in $lane_tmp" >&2; fi
  echo "=== lane $lane: pytest exit $rc after $((SECONDS - start)) s" >&2
  [ $rc -eq 0 ] || status=1
done
exit $status
