#!/usr/bin/env bash
# Set up the current lane (cached venv), apply the patch set, and run the main job.
#   usage: tools/demo.sh [LANE=current] [minicpmo-cg-demo args...]   e.g. tools/demo.sh --quick
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lane=current
case "${1:-}" in
  current|legacy) lane="$1"; shift ;;
  ""|-*) ;;
  *) echo "usage: tools/demo.sh [current|legacy] [minicpmo-cg-demo args...] (unknown lane '$1')" >&2; exit 2 ;;
esac
venv="$(bash "$root/tools/setup_lane.sh" "$lane" | tail -n 1)"
"$venv/bin/minicpmo-cg-patch" apply >&2
exec "$venv/bin/minicpmo-cg-demo" "$@"
