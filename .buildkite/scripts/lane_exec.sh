#!/usr/bin/env bash
# Run a command inside a lane's venv with the patch set applied (what tools/test.sh does before
# pytest, for commands that are not pytest, e.g. tests/e2e/serve_smoke.py).
#   usage: .buildkite/scripts/lane_exec.sh {current|legacy} COMMAND [ARGS...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
lane="${1:-}"; shift || true
case "$lane" in
  current|legacy) ;;
  *) echo "usage: .buildkite/scripts/lane_exec.sh {current|legacy} COMMAND [ARGS...]" >&2; exit 2 ;;
esac
[ $# -gt 0 ] || { echo "lane_exec: no command" >&2; exit 2; }
venv="$(bash "$root/tools/setup_lane.sh" "$lane" | tail -n 1)"
"$venv/bin/minicpmo-cg-patch" apply >&2
"$venv/bin/minicpmo-cg-patch" status >&2 || true
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
cd "$root"
exec "$@"
