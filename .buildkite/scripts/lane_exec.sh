#!/usr/bin/env bash
# Run a command inside a lane's venv with the patch set applied (what tools/test.sh does before
# pytest, for commands that are not pytest, e.g. tests/helpers/serve_smoke.py).
#   usage: .buildkite/scripts/lane_exec.sh LANE COMMAND [ARGS...]     (LANE: a lanes/LANE.txt)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
lane="${1:-}"; shift || true
if [ -z "$lane" ] || [ ! -f "$root/lanes/$lane.txt" ]; then
  echo "usage: .buildkite/scripts/lane_exec.sh LANE COMMAND [ARGS...]; lanes: $(cd "$root/lanes" && ls -- *.txt | sed 's/\.txt$//' | xargs)" >&2
  exit 2
fi
[ $# -gt 0 ] || { echo "lane_exec: no command" >&2; exit 2; }
# shellcheck source=tools/lane_env.sh
source "$root/tools/lane_env.sh"
venv="$(lane_venv "$lane")"
lock_lane_venv "$venv"  # kept by the command (exec), as tools/test.sh keeps it for pytest
bash "$root/tools/setup_lane.sh" "$lane" >/dev/null
"$venv/bin/minicpmo-cg-patch" apply >&2
"$venv/bin/minicpmo-cg-patch" status >&2 || true
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
cd "$root"
exec "$@"
