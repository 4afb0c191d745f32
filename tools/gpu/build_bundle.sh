#!/usr/bin/env bash
# Build the offline GPU bundle of one or more lanes (run HERE, on a machine that reaches PyPI).
#
#   usage: tools/gpu/build_bundle.sh [--out DIR] [--unpatched] [--verify|--no-verify] [LANE ...]
#          LANE: current (default) | legacy ; DIR default .gpubundle (git-ignored)
#
# Per lane it writes DIR/LANE/site.tar.xz + DIR/LANE/MANIFEST.json. The tarball is a ready
# site-packages dir for the GPU host (Python 3.12, torch 2.11, no network, no vLLM):
#   1. the lane's pinned vllm + vllm-omni wheels (lanes/LANE.txt), stripped by
#      tools/gpu/bundle_lib.py:classify (no native .so/executables - they are built for torch
#      2.13 -, no C/CUDA sources/headers, web assets, docs; vllm-omni media kept);
#   2. THIS checkout's patch series applied offline by the patch tool
#      (python -m minicpmo_cg.patchtool apply --site-packages SITE), which also copies the adapter;
#   3. the py3.12 manylinux wheels of tools/gpu/deps.txt, installed (pip --target);
#   4. the stubs of tools/gpu/stubs/ (import-only stand-ins for two native vLLM modules).
# MANIFEST.json records the pins, the payload fingerprint (patches + adapter + stubs + deps list:
# run.sh refuses a stale bundle), the strip statistics and the import check result.
#
# --verify (default when the host-like venv exists) imports the GPU-side modules from the built
# site with a Python 3.12 venv holding the GPU host's packages and a faked NVML
# (tools/gpu/hostsim_check.py); --verify creates that venv if missing (~4 GB, a few minutes).
# Downloads are cached under ${MINICPMO_CG_CACHE:-~/.cache/minicpmo-cg}/gpu-bundle.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIB=(python3 "$HERE/bundle_lib.py")
OUTDIR="$ROOT/.gpubundle"
PATCHED=true
VERIFY=auto
LANES_ARG=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    --unpatched) PATCHED=false; shift ;;
    --verify) VERIFY=yes; shift ;;
    --no-verify) VERIFY=no; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "build_bundle: unknown option $1" >&2; exit 2 ;;
    *) LANES_ARG+=("$1"); shift ;;
  esac
done
[ ${#LANES_ARG[@]} -gt 0 ] || LANES_ARG=(current)

CACHE="${MINICPMO_CG_CACHE:-$HOME/.cache/minicpmo-cg}/gpu-bundle"
HOSTSIM="$CACHE/hostsim-py3.12"
PIP=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null python3 -m pip)
PY312=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 5 17 24 26 27 28 31 34 35; do PY312+=(--platform "manylinux_2_${n}_x86_64"); done
PY312+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p "$CACHE/upstream" "$CACHE/wheels-py312" "$OUTDIR"
# One build at a time per output dir (a second one waits): two builds of a lane would race on it.
if command -v flock >/dev/null; then
  exec 9>"$OUTDIR/.build.lock"
  flock -n 9 || { echo "build_bundle: another build holds $OUTDIR/.build.lock; waiting ..." >&2; flock 9; }
fi

# The patch tool is stdlib-only; the current lane's venv is preferred (the project's own
# environment), any python3 >= 3.10 with this checkout on PYTHONPATH works too.
PATCH_PY="${PATCH_PY:-}"
if [ -z "$PATCH_PY" ]; then
  PATCH_PY="$(ls -d "${MINICPMO_CG_CACHE:-$HOME/.cache/minicpmo-cg}"/venv-current-py*/bin/python 2>/dev/null | head -1 || true)"
  [ -n "$PATCH_PY" ] || PATCH_PY=python3
fi

ensure_hostsim() {
  [ -x "$HOSTSIM/bin/python" ] && return 0
  [ "$VERIFY" = yes ] || return 1
  echo "== creating the host-like Python 3.12 venv $HOSTSIM (torch 2.11, transformers 5.17; ~4 GB)"
  local py312
  py312="$(command -v python3.12 || true)"
  [ -n "$py312" ] && "$py312" -c 'import sys' 2>/dev/null || py312="$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
  [ -n "$py312" ] || { echo "build_bundle: --verify needs a python3.12" >&2; return 1; }
  rm -rf "$HOSTSIM"
  "$py312" -m venv "$HOSTSIM"
  # The GPU image's packages that vLLM / vllm-omni / the tests touch (KINDS.md's list), at the
  # versions the image has where known. pydantic & co. come in as deps and are removed again:
  # the image lacks them, the bundle carries them.
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$HOSTSIM/bin/python" -m pip install -q \
    torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.17.0 numpy pillow scipy \
    scikit-image pytest pytest-timeout regex psutil sentencepiece requests tqdm py-cpuinfo huggingface_hub \
    tokenizers safetensors protobuf aiohttp prometheus_client tiktoken opencv-python-headless pyyaml six \
    setuptools einops cloudpickle ninja numba msgpack filelock typing_extensions jinja2 uvloop accelerate \
    onnxruntime flatbuffers
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$HOSTSIM/bin/python" -m pip uninstall -q -y \
    pydantic pydantic-core annotated-types typing-inspection
}

pids=()
trap 'wait' EXIT  # a failing lane still lets the lanes already packing finish cleanly
for lane in "${LANES_ARG[@]}"; do
  t0=$SECONDS
  read -r vllm_spec omni_spec <<<"$("${LIB[@]}" pins "$lane")"
  vllm_v="${vllm_spec#vllm==}"; omni_v="${omni_spec#vllm-omni==}"
  echo "== lane $lane: vllm $vllm_v + vllm-omni $omni_v (patched: $PATCHED)"

  # 1. upstream wheels (vllm's is ~315 MB: cached)
  for spec in "$vllm_spec" "$omni_spec"; do
    name="${spec%%==*}"; ver="${spec#*==}"
    ls "$CACHE/upstream/${name//-/_}-$ver-"*.whl >/dev/null 2>&1 || \
      "${PIP[@]}" download -q --no-deps "${PY312[@]}" -d "$CACHE/upstream" "$spec"
  done
  vllm_whl="$(ls "$CACHE/upstream/vllm-$vllm_v-"*.whl | head -1)"
  omni_whl="$(ls "$CACHE/upstream/vllm_omni-$omni_v-"*.whl | head -1)"

  # 2. dependency wheels (pinned in deps.txt), downloaded once
  mapfile -t deps < <("${LIB[@]}" deps "$lane")
  "${PIP[@]}" download -q --no-deps "${PY312[@]}" -d "$CACHE/wheels-py312" "${deps[@]}"

  work="$(mktemp -d "${TMPDIR:-/tmp}/gpubundle-$lane.XXXXXX")"
  site="$work/site"
  # 3. stripped upstream code
  "${LIB[@]}" extract "$site" "$vllm_whl" "$omni_whl"
  # 4. this checkout's patches + adapter, applied offline
  if [ "$PATCHED" = true ]; then
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$PATCH_PY" -m minicpmo_cg.patchtool apply --site-packages "$site") \
      > "$work/patch.log" 2>&1 || { cat "$work/patch.log"; echo "build_bundle: patch apply failed for lane $lane" >&2; exit 1; }
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$PATCH_PY" -m minicpmo_cg.patchtool check --site-packages "$site") \
      >> "$work/patch.log" 2>&1 || { cat "$work/patch.log"; echo "build_bundle: patch check failed for lane $lane" >&2; exit 1; }
    grep -E "^(apply|check):" "$work/patch.log" | sed 's/^/  /'
  fi
  # 5. dependencies, installed for cp312 (no bytecode: the host compiles on first import)
  "${PIP[@]}" install -q --no-index --find-links "$CACHE/wheels-py312" --no-deps --no-compile \
    "${PY312[@]}" --target "$site" "${deps[@]}" 2>&1 | grep -v "Running pip as the 'root' user" || true
  "${LIB[@]}" strip-site "$site"
  # 6. stubs (their headers say what each stands in for and why that is safe)
  cp -r "$HERE/stubs/." "$site/"
  find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +

  # 7. import check on a host-like Python 3.12 (see hostsim_check.py)
  hostsim=skipped
  if [ "$VERIFY" != no ] && ensure_hostsim; then
    if (cd "$work" && PYTHONPATH="$site:$ROOT" "$HOSTSIM/bin/python" "$HERE/hostsim_check.py" --fake-cuda-platform \
          > "$work/hostsim.log" 2>&1); then
      hostsim=ok; echo "  host-like import check: ok ($(grep -c '^ok ' "$work/hostsim.log") modules)"
    else
      hostsim=FAILED; grep -E "^(FAIL|[0-9]+ failed)" "$work/hostsim.log" | sed 's/^/  /'
      echo "build_bundle: import check failed for lane $lane (log: $work/hostsim.log)" >&2; exit 1
    fi
    find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
  else
    echo "  host-like import check skipped (pass --verify to create $HOSTSIM)"
  fi

  # 8. pack (xz -9: Python source packs ~2x tighter than the wheels' deflate), lanes in parallel;
  #    the lane dir is replaced only once its new content is complete
  lane_dir="$OUTDIR/$lane"
  (
    new="$work/out"; mkdir -p "$new"
    "${LIB[@]}" pack "$site" "$new/site.tar.xz"
    "${LIB[@]}" manifest "$new" lane="$lane" vllm="$vllm_v" vllm_omni="$omni_v" patched="$PATCHED" \
      hostsim_check="$hostsim" deps="$(IFS=' '; echo "${deps[*]}")" strip=@"$work/strip-stats.json" \
      site_bytes="$(du -sb "$site" | cut -f1)" git_head="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo none)" \
      >/dev/null
    rm -rf "$lane_dir.old"
    [ -d "$lane_dir" ] && mv "$lane_dir" "$lane_dir.old"
    mv "$new" "$lane_dir" && rm -rf "$lane_dir.old" "$work"
    echo "== lane $lane done: $(du -sh "$lane_dir/site.tar.xz" | cut -f1) in $((SECONDS - t0)) s"
  ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc -eq 0 ] || { echo "build_bundle: packing failed" >&2; exit 1; }

echo "== sizes (limit: 64 MiB per device call, working tree + carried paths)"
"${LIB[@]}" carry-report "$OUTDIR" || echo "WARNING: a lane does not fit the carry limit" >&2
