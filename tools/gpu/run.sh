#!/usr/bin/env bash
# Run the CUDA tests, the main job and the benchmark of one lane on the offline GPU host.
#
#   usage: bash tools/gpu/run.sh LANE [PART ...] [--quick] [--budget S] [--dry-run | --preflight]
#     LANE   current | legacy (needs .gpubundle/LANE, made here by tools/gpu/build_bundle.sh LANE)
#     PART   tests | demo | bench   (default: all three, run in the order given)
#     --quick      pass --quick to the main job and the benchmark
#     --budget S   seconds for all parts together (default 540; one device command may run 600)
#     --dry-run    print what would run (install, exports, one command line per part) and exit
#     --preflight  --dry-run, and fail unless the bundle is present and fresh (run it HERE before
#                  spending a device call)
#
# On the GPU host it is called from the repo root by the device tool, with $OUT set:
#   carry [".gpubundle/LANE"] (or [".gpubundle"]), command `bash tools/gpu/run.sh LANE tests demo bench`.
# Steps: check the bundle's payload fingerprint against this checkout; unpack the bundle into
# /tmp/site-LANE (a few seconds); export PYTHONPATH=/tmp/site-LANE:<repo>; print versions and the
# device; run each part under `timeout` with its own log in $OUT; print each log's tail and a
# summary. A failing part does not stop the others; exit status 0 only when all parts passed.
# Files written to $OUT (7, under the device tool's limit of 8): run-LANE.log, tests-LANE.log,
# junit-LANE.xml, demo-LANE.log, demo-LANE.json, bench-LANE.log, bench-LANE.json.
# Environment overrides: PY (python3), OUT (./out/gpu-LANE), GPU_BUNDLE_DIR (.gpubundle),
# GPU_SITE (/tmp/site-LANE), TEST_MARKERS, TEST_ARGS, DEMO_ARGS, BENCH_ARGS, TAIL_LINES (25).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$SECONDS

usage() { sed -n '2,25p' "$0"; }
die() { echo "run.sh: $*" >&2; exit 2; }

LANE=""; PARTS=(); QUICK=""; BUDGET=540; MODE=run
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick"; shift ;;
    --budget) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || die "--budget needs seconds"; BUDGET="$2"; shift 2 ;;
    --budget=*) BUDGET="${1#--budget=}"; [[ "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget needs seconds"; shift ;;
    --dry-run) MODE=dry; shift ;;
    --preflight) MODE=preflight; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *)
      if [ -z "$LANE" ]; then LANE="$1"
      else
        case "$1" in tests|demo|bench) PARTS+=("$1") ;; *) die "unknown part '$1' (tests, demo, bench)" ;; esac
      fi
      shift ;;
  esac
done
[ -n "$LANE" ] || { usage >&2; exit 2; }
case "$LANE" in current|legacy) ;; *) die "unknown lane '$LANE' (current, legacy)" ;; esac
[ ${#PARTS[@]} -gt 0 ] || PARTS=(tests demo bench)
# each part at most once, in the order first given
declare -A SEEN=(); UNIQ=()
for p in "${PARTS[@]}"; do [ -n "${SEEN[$p]:-}" ] || { SEEN[$p]=1; UNIQ+=("$p"); }; done
PARTS=("${UNIQ[@]}")

PY="${PY:-python3}"
OUT="${OUT:-$ROOT/out/gpu-$LANE}"
BUNDLE="${GPU_BUNDLE_DIR:-$ROOT/.gpubundle}/$LANE"
SITE="${GPU_SITE:-/tmp/site-$LANE}"
TAIL_LINES="${TAIL_LINES:-25}"
# CPU tests are cheap and run too (policy, wiring, patches on the vLLM side). tests/patches is left
# out: it tests the patch tool against a pip-installed vLLM in the interpreter's site-packages,
# while here the bundle is patched offline and lives on PYTHONPATH (those tests run on CPU CI).
TEST_MARKERS="${TEST_MARKERS:-cuda or multi_gpu or core_model}"
TEST_ARGS="${TEST_ARGS:---ignore=tests/patches}"
DEMO_ARGS="${DEMO_ARGS:-}"
BENCH_ARGS="${BENCH_ARGS:-}"
# Per-part caps (s); a part also never gets more than what is left of --budget.
declare -A CAP=([tests]=240 [demo]=150 [bench]=300)

part_cmd() {
  case "$1" in
    tests) echo "$PY -m pytest tests -m \"$TEST_MARKERS\" -p no:cacheprovider -q -rs --junitxml=$OUT/junit-$LANE.xml $TEST_ARGS" ;;
    demo)  echo "$PY -m minicpmo_cg.main_job $QUICK --json $OUT/demo-$LANE.json $DEMO_ARGS" ;;
    bench) echo "$PY benchmarks/encoder_cuda_graph_bench.py $QUICK --json $OUT/bench-$LANE.json $BENCH_ARGS" ;;
  esac
}

EXPORTS=(
  "PYTHONPATH=$SITE:$ROOT"        # bundle first: its patched vllm_omni must win over the repo's vllm_omni/ dir
  "PYTHONUNBUFFERED=1"
  "HF_HUB_OFFLINE=1" "TRANSFORMERS_OFFLINE=1"   # no network there: fail fast instead of retrying
  "VLLM_NO_USAGE_STATS=1" "DO_NOT_TRACK=1" "TOKENIZERS_PARALLELISM=false"
  "NCCL_NVLS_ENABLE=0" "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" "NVSHMEM_DISABLE_NVLS=1"  # KINDS.md: keep multicast off
)

bundle_status() { "$PY" "$ROOT/tools/gpu/bundle_lib.py" check "$BUNDLE"; }

if [ "$MODE" != run ]; then
  echo "# run.sh $LANE ${PARTS[*]} ($MODE): nothing is executed"
  status="$(bundle_status)"; brc=$?
  echo "# bundle: $status"
  echo "rm -rf $SITE && mkdir -p $SITE && tar -xJf $BUNDLE/site.tar.xz -C $SITE"
  for e in "${EXPORTS[@]}"; do echo "export $e"; done
  left=$BUDGET
  for p in "${PARTS[@]}"; do
    t=${CAP[$p]}; [ "$t" -le "$left" ] || t=$left
    echo "[$p] timeout -k 10 $t $(part_cmd "$p") > $OUT/$p-$LANE.log 2>&1"
  done
  echo "# files in \$OUT: run-$LANE.log $(for p in "${PARTS[@]}"; do case $p in tests) echo -n "tests-$LANE.log junit-$LANE.xml ";; *) echo -n "$p-$LANE.log $p-$LANE.json ";; esac; done)"
  if [ "$MODE" = preflight ]; then
    [ $brc -eq 0 ] || { echo "preflight: FAILED ($status)" >&2; exit $brc; }
    "$PY" "$ROOT/tools/gpu/bundle_lib.py" carry-report "$(dirname "$BUNDLE")" | grep -E "working tree|lane $LANE " || true
    echo "preflight: OK"
  fi
  exit 0
fi

# ------------------------------------------------------------------------------------------------
mkdir -p "$OUT" || die "cannot create OUT=$OUT"
exec > >(tee -a "$OUT/run-$LANE.log") 2>&1
hr() { printf '=%.0s' {1..100}; echo; }
hr; echo "run.sh $LANE: parts ${PARTS[*]} | budget ${BUDGET}s | OUT=$OUT | $(date -u +%FT%TZ)"; hr

# 1. bundle: present and built from this checkout's patches/adapter/stubs/deps?
status="$(bundle_status)"; brc=$?
echo "$status"
if [ $brc -eq 4 ]; then
  echo "FATAL: no bundle for lane $LANE. Build it where PyPI is reachable: bash tools/gpu/build_bundle.sh $LANE"
  echo "SUMMARY $LANE: install FAILED (no bundle); parts not run: ${PARTS[*]}"
  exit 4
fi

# 2. install (unpack) the bundle
t0=$SECONDS
rm -rf "$SITE" && mkdir -p "$SITE"
if ! tar -xJf "$BUNDLE/site.tar.xz" -C "$SITE" 2>/dev/null; then  # no xz binary there? Python's lzma then
  rm -rf "$SITE" && mkdir -p "$SITE"
  "$PY" -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' \
    "$BUNDLE/site.tar.xz" "$SITE"
fi
irc=$?
echo "install: unpacked $BUNDLE/site.tar.xz into $SITE in $((SECONDS - t0)) s (rc $irc, $(du -sm "$SITE" 2>/dev/null | cut -f1) MB)"
if [ $irc -ne 0 ]; then
  echo "SUMMARY $LANE: install FAILED (tar rc $irc); parts not run: ${PARTS[*]}"; exit 4
fi
for e in "${EXPORTS[@]}"; do export "$e"; done

# 2b. a stale bundle (patches/adapter changed since the build) is re-patched here from this
# checkout when possible: revert the bundle's applied series byte-exactly, apply the current one.
if [ $brc -eq 3 ]; then
  echo "WARNING: $status"
  if command -v patch >/dev/null && "$PY" -m minicpmo_cg.patchtool revert --site-packages "$SITE" >/dev/null 2>&1 \
      && "$PY" -m minicpmo_cg.patchtool apply --site-packages "$SITE" > "$SITE/.repatch.log" 2>&1; then
    cp -r "$ROOT/tools/gpu/stubs/." "$SITE/"
    echo "WARNING: re-patched the unpacked bundle from this checkout (deps.txt changes still need a rebuild)"
  else
    echo "FATAL: stale bundle and re-patching here failed; rebuild: bash tools/gpu/build_bundle.sh $LANE"
    echo "SUMMARY $LANE: install FAILED (stale bundle); parts not run: ${PARTS[*]}"
    exit 3
  fi
fi

# 3. versions and device
echo "--- device"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | sed 's/^/  /'
else
  echo "  nvidia-smi: not found"
fi
echo "--- software"
timeout 120 "$PY" - <<'PYEOF' 2>&1 | grep -v -E "^(INFO|WARNING|DEBUG) " | sed 's/^/  /'
import importlib.metadata as md, platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda devices: {torch.cuda.device_count()}; 0: {p.name}, cc {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
else:
    print("cuda devices: none (torch.cuda.is_available() is False)")
for d in ("vllm", "vllm-omni", "transformers", "triton", "numpy"):
    try:
        print(f"{d} {md.version(d)}", end="; ")
    except md.PackageNotFoundError:
        print(f"{d} missing", end="; ")
print()
import vllm, vllm_omni
from vllm.platforms import current_platform
print(f"vllm from {vllm.__file__}; platform {type(current_platform).__name__}")
import vllm_omni.model_executor.models.minicpmo_4_5.encoder_cuda_graph as a
print(f"adapter {a.__file__}")
PYEOF
"$PY" -m minicpmo_cg.patchtool status --site-packages "$SITE" 2>&1 | awk 'NR>1 && $1 != "PATCH" {print "  " ($1 == "installed:" ? $0 : $1 "  " $3)}' | head -12

# 4. parts
declare -A RC=() SECS=()
FAILED=0
for p in "${PARTS[@]}"; do
  left=$((BUDGET - (SECONDS - START)))
  t=${CAP[$p]}; [ "$t" -le "$left" ] || t=$left
  log="$OUT/$p-$LANE.log"
  cmd="$(part_cmd "$p")"
  hr; echo "[$p] $cmd   (timeout ${t}s, log $log)"
  if [ "$t" -lt 20 ]; then
    echo "[$p] SKIPPED: only ${left}s of the ${BUDGET}s budget left"; RC[$p]=skipped; SECS[$p]=0; FAILED=1; continue
  fi
  t0=$SECONDS
  timeout -k 10 "$t" bash -c "$cmd" > "$log" 2>&1 < /dev/null
  rc=$?
  SECS[$p]=$((SECONDS - t0))
  case $rc in 124|137) RC[$p]="timeout"; FAILED=1 ;; 0) RC[$p]=0 ;; *) RC[$p]=$rc; FAILED=1 ;; esac
  if [ "$p" = bench ] && grep -q "^=== RESULTS" "$log"; then
    sed -n '/^=== RESULTS/,$p' "$log"            # the benchmark's whole table
  else
    tail -n "$TAIL_LINES" "$log"
  fi
  echo "[$p] rc=${RC[$p]} in ${SECS[$p]} s"
done

# 5. summary
hr
echo "SUMMARY $LANE (total $((SECONDS - START)) s of budget ${BUDGET}s):"
for p in "${PARTS[@]}"; do
  status=ok; [ "${RC[$p]}" = 0 ] || status="FAILED (${RC[$p]})"
  printf '  %-6s %-16s %5s s\n' "$p" "$status" "${SECS[$p]}"
done
echo "  files: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $FAILED
