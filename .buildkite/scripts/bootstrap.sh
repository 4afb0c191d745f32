#!/usr/bin/env bash
# First step of every build (.buildkite/pipeline.yml): run upload_pipeline.py with PyYAML from
# a throwaway venv (the agent's system Python may lack it and refuse --user installs, PEP 668),
# and hand its pipeline to the agent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$(mktemp -d -t minicpmo-cg-bk.XXXXXX)"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "pyyaml==6.0.4"
"$venv/bin/python" "$root/.buildkite/scripts/upload_pipeline.py" --upload
