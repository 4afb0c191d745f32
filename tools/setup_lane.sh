#!/usr/bin/env bash
# Create (or reuse) the virtual environment of one pinned lane and install this patch set into it.
#   usage: tools/setup_lane.sh LANE     (LANE: a lanes/LANE.txt, e.g. current) prints the venv's path on the last line of stdout
# The venv is cached under ${MINICPMO_CG_CACHE:-~/.cache/minicpmo-cg}, keyed by the sha256 of
# lanes/<lane>.txt and the Python version, so a change of pins builds a new one (~4 min, ~9 GB) and
# anything else reuses it. The pip prefix ignores a machine-wide pip config / PIP_FIND_LINKS whose
# CPU torch breaks vLLM's CUDA torchvision (see README "Install"); on an ordinary machine it is a no-op.
# The venv is locked while this runs (tools/lane_env.sh): another checkout's run waits, saying so.
set -euo pipefail
lane="${1:-}"; [ -n "$lane" ] || { echo "usage: tools/setup_lane.sh LANE (a lanes/LANE.txt)" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pins="$root/lanes/$lane.txt"
[ -f "$pins" ] || { echo "setup_lane: unknown lane '$lane' (have: $(ls "$root/lanes" | sed 's/\.txt//' | tr '\n' ' '))" >&2; exit 2; }
py="${PYTHON:-python3}"
# shellcheck source=tools/lane_env.sh
source "$root/tools/lane_env.sh"
venv="$(lane_venv "$lane")"
cache="$(dirname "$venv")"
lock_lane_venv "$venv"  # held until this script exits, or already held by the caller (tools/test.sh)
pip=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip)
if [ ! -f "$venv/.complete" ]; then
  echo "setup_lane: building $venv from lanes/$lane.txt (first time: ~4 min, ~9 GB)" >&2
  rm -rf "$venv"; mkdir -p "$cache"
  "$py" -m venv "$venv"
  "${pip[@]}" install -q --upgrade pip >&2
  "${pip[@]}" install --progress-bar off -r "$pins" >&2
  touch "$venv/.complete"
else
  echo "setup_lane: reusing $venv" >&2
fi
# The patch set itself: editable, no dependency resolution (the lane file pins everything).
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
