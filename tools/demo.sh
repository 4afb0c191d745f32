#!/usr/bin/env bash
# Set up a lane (cached venv), apply the patch set, and run the demo (minicpmo-cg-demo).
#   usage: tools/demo.sh [LANE=current] [minicpmo-cg-demo args...]   e.g. tools/demo.sh --full
#   (LANE: a lanes/LANE.txt; without CUDA the demo runs its reduced size unless given --full)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lane=current
case "${1:-}" in
  ""|-*) ;;
  *)
    if [ ! -f "$root/lanes/$1.txt" ]; then
      lanes="$(cd "$root/lanes" && ls -- *.txt | sed 's/\.txt$//' | xargs)"
      echo "usage: tools/demo.sh [LANE] [minicpmo-cg-demo args...]; unknown lane '$1' (lanes: $lanes)" >&2; exit 2
    fi
    lane="$1"; shift ;;
esac
# shellcheck source=tools/lane_env.sh
source "$root/tools/lane_env.sh"
venv="$(lane_venv "$lane")"
lock_lane_venv "$venv"  # kept by the demo process (exec): setup, apply and the demo see one checkout
bash "$root/tools/setup_lane.sh" "$lane" >/dev/null
"$venv/bin/minicpmo-cg-patch" apply >&2
exec "$venv/bin/minicpmo-cg-demo" "$@"
