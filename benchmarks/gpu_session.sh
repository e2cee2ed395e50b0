#!/usr/bin/env bash
# One GPU session of recopt, on a GPU host without a package index (Python 3.12, torch 2.11 +
# CUDA 13, 16 cores), in calls that each end within the device tool's 10 minutes per command:
#
#   bash benchmarks/gpu_session.sh check     # HERE, before any device call: the size it carries
#   bash benchmarks/gpu_session.sh core      # a 15-minute lease: the cuda tier, id maps, kernels
#                                            # DLRM/A, DLRM vs TorchRec (about 5 min; then `contract`)
#   bash benchmarks/gpu_session.sh tests     # smoke, compiled Triton tests, test_cuda.py, the
#                                            # rest of -m cuda, then the suite in the time left
#   bash benchmarks/gpu_session.sh contract  # the shared-GPU contract test, alone in its call
#   bash benchmarks/gpu_session.sh bench     # bench_gpu.py: kernels A/B/C/DLRM, DLRM vs TorchRec, UVM
#   bash benchmarks/gpu_session.sh suite     # only the non-cuda suite, when `tests` ran out of time
#                                            # (PART=1/2 and PART=2/2: half the test files each)
#   bash benchmarks/gpu_session.sh smoke     # only the smoke check
#   bash benchmarks/gpu_session.sh idmap     # bench_id_map.py on CUDA (issue 26's cost target)
#
# Run from the repository root with .gpu/ beside it (../shared/gpu/pack_fbgemm.sh --torchrec made
# it here; the call carries it). The script first does what pack_fbgemm.sh's two printed lines
# do (unpack fbgemm into /tmp/site, install .gpu/whl there), only where /tmp/site lacks them, and
# installs .gpu/wheels (benchmarks/gpu_test_wheels.sh) only if pytest is missing. Everything it
# writes goes to $OUT (./gpu-out when OUT is unset) as it is written, flat and at most 7 files a
# mode (tests: summary, smoke, triton, cuda_checks, cuda, suite logs and the suite's XML), so what a step wrote before a time limit stopped it comes back. Every step has its own
# `timeout`, and together they end before DEADLINE_S (default 570 s) after the start. Each step
# runs in its own process group, killed when the step ends, so no rank process it spawned holds
# the GPU for the next step (recopt.testing.run_on_ranks kills its ranks itself as well).
set -u -o pipefail
mode=${1:-}
start=$(date +%s)
deadline=$((start + ${DEADLINE_S:-570}))
out=${OUT:-$PWD/gpu-out}
[ "$mode" = check ] || mkdir -p "$out"  # `check` runs here: it writes nothing to the checkout
site=${GPU_SITE:-/tmp/site}  # where pack_fbgemm.sh's lines unpack (GPU_SITE: elsewhere)

# Seconds a step may take: at most $1, and never past the deadline (0: no time left).
budget() {
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt "$1" ]; then echo $((left > 0 ? left : 0)); else echo "$1"; fi
}

say() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$out/summary.txt"; }

# limited SECONDS CMD...: CMD under `timeout`, or not at all with 10 s or less left (a
# `timeout 0` would never stop it). Returns CMD's status (124: cut off; 125: not run).
# `timeout` makes its own process group (its pid); whatever is left in it once CMD has ended
# (ranks of a test that timed out) is killed before the next step starts.
limited() {
  local limit=$1 pid rc
  shift
  if [ "$limit" -le 10 ]; then echo "no time left for: $*"; return 125; fi
  timeout --kill-after=10 "$limit" "$@" &
  pid=$!
  wait "$pid"
  rc=$?
  if kill -0 -- "-$pid" 2>/dev/null; then
    echo "killing what the step left running: $(ps -o pid=,args= -g "$pid" 2>/dev/null | head -n 5)"
    kill -KILL -- "-$pid" 2>/dev/null
  fi
  return "$rc"
}

# Bytes the device tool would carry: the files git does not ignore (tracked or not), plus .gpu.
carried_bytes() {
  local tree gpu
  tree=$(git ls-files -z --cached --others --exclude-standard -- . ':(exclude).gpu' \
    | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
  gpu=$(du -sb .gpu 2>/dev/null | cut -f1)
  echo $((tree + ${gpu:-0}))
}

# Run here, before the device: fails when the checkout and .gpu exceed what a call may carry.
check() {
  local bytes limit=$((64 * 1024 * 1024))
  bytes=$(carried_bytes)
  echo "checkout + .gpu: $((bytes / 1024 / 1024)) MiB of the $((limit / 1024 / 1024)) MiB a device call may carry"
  [ -d .gpu ] || echo "no .gpu here: run ../shared/gpu/pack_fbgemm.sh --torchrec first"
  if [ "$bytes" -gt "$limit" ]; then
    echo "too large by $(((bytes - limit) / 1024)) KiB: remove untracked files, or pack without --torchrec"
    return 1
  fi
}

setup() {
  export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1
  export RECOPT_CACHE_DIR=/tmp/recopt-cache  # AUTO's decisions: nothing under ~/.cache
  if [ ! -d "$site/fbgemm_gpu" ]; then
    [ -f .gpu/fbgemm.tar.xz ] || { say "no .gpu/fbgemm.tar.xz: run ../shared/gpu/pack_fbgemm.sh here and carry .gpu"; return 1; }
    python3 -c "import tarfile; tarfile.open('.gpu/fbgemm.tar.xz').extractall('$site')" || return 1
  fi
  if [ -d .gpu/whl ] && [ ! -d "$site/torchrec" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" .gpu/whl/*.whl
  fi
  if ! python3 -c "import pytest, pytest_timeout, hypothesis" 2>/dev/null && [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" .gpu/wheels/*.whl
  fi
  say "setup done: $(python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -n 1)"
}

smoke() {
  limited "$(budget 120)" python3 benchmarks/gpu_smoke.py > "$out/smoke.txt" 2>&1
  local rc=$?
  cat "$out/smoke.txt"
  say "smoke: exit $rc"
}

# pytest with its log (-v: a line a test, as it runs) under $out, and its JUnit XML when
# XML=1 (only for the suite: a call returns at most 8 files): run_pytest NAME SECONDS ARGS...
run_pytest() {
  local name=$1 limit=$2 xml=()
  shift 2
  [ "${XML:-0}" = 1 ] && xml=(--junitxml="$out/$name.xml")
  if [ "$limit" -le 10 ]; then say "$name: skipped, no time left"; return; fi
  limited "$limit" python3 -m pytest -p no:cacheprovider -rfEs "${xml[@]}" "$@" \
    > "$out/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc ($( [ "$rc" = 124 ] && echo "cut off at ${limit}s; see $name.log" || tail -n 1 "$out/$name.log"))"
}

# The rest of the suite, on worker processes when pytest-xdist is there (16 cores). PART=K/N
# runs every N-th test file from the K-th (sorted), for a suite too long for one call.
suite() {
  local parallel=() files=(tests)
  if python3 -c "import xdist" 2>/dev/null; then
    parallel=(-n "${WORKERS:-12}" --dist loadfile)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}  # 12 workers x 2 threads on 16 cores
  fi
  if [ -n "${PART:-}" ]; then
    mapfile -t files < <(ls tests/test_*.py | sort | awk -v k="${PART%/*}" -v n="${PART#*/}" 'NR % n == k % n')
  fi
  XML=1 run_pytest suite "$(budget 570)" -m "not cuda" -v "${parallel[@]}" "${files[@]}"
  grep -E "^(FAILED|ERROR)" "$out/suite.log" 2>/dev/null | head -n 40
}

# The cuda tier on one process, each step's log kept as it comes: the Triton kernels compiled
# (no interpreter on a GPU host), then test_cuda.py's CPU-vs-CUDA checks, then the rest of the
# tier without the shared-GPU contract test (its own call: `contract`).
cuda_tier() {
  run_pytest triton "$(budget 120)" -v tests/test_triton_sparse.py tests/test_triton_adafactor.py
  run_pytest cuda_checks "$(budget 150)" -v tests/test_cuda.py
  run_pytest cuda "$(budget 200)" -m cuda -v \
    --ignore=tests/test_triton_sparse.py --ignore=tests/test_triton_adafactor.py \
    --ignore=tests/test_sharding_contract.py --ignore=tests/test_cuda.py
  grep -hE "^(FAILED|ERROR)" "$out"/triton.log "$out"/cuda_checks.log "$out"/cuda.log 2>/dev/null | head -n 40
}

tests() {
  smoke
  cuda_tier
  suite  # the rest of the suite in the time left
}

# A 15-minute lease in one call of about 5 minutes (2026-11-28 on an H200: setup 16 s, smoke
# 16 s, Triton 19 s, test_cuda.py 50 s, the rest of the tier 54 s, the id-map figures about
# 30 s, kernels DLRM and A 54 s, the DLRM step against TorchRec 23 s): the cuda tier, then the
# id-map figures and the GPU figures that matter most. Seven files at most: the benchmarks'
# JSON and tables stay under /tmp and their tables go into bench.log.
core() {
  smoke
  cuda_tier
  idmap
  limited "$(budget 120)" python3 benchmarks/bench_gpu.py --configs DLRM,A --dlrm-dims \
    --out /tmp/recopt-kernels.json >> "$out/bench.log" 2>&1
  say "kernels DLRM, A: exit $?"
  limited "$(budget 90)" python3 benchmarks/bench_gpu.py --skip-kernels \
    --out /tmp/recopt-dlrm.json >> "$out/bench.log" 2>&1
  say "dlrm: exit $?"
  for f in kernels dlrm; do
    [ -f "/tmp/recopt-$f.md" ] && tee -a "$out/bench.log" < "/tmp/recopt-$f.md"
  done
}

contract() {
  # Six tests (2 and 3 ranks x three parts of the cases), each run_on_ranks under 240 s.
  run_pytest contract "$(budget 560)" -v tests/test_sharding_contract.py -m cuda
  grep -E "^(FAILED|ERROR)" "$out/contract.log" 2>/dev/null | head -n 40
}

bench() {
  # Kernels: config DLRM (power-law ids; small, so first) then A, B, C, each row written as it
  # is measured; no DLRM step here.
  limited "$(budget 330)" python3 benchmarks/bench_gpu.py --configs DLRM,A,B,C \
    --out "$out/kernels.json" --dlrm-dims >> "$out/bench.log" 2>&1
  say "kernels: exit $?"
  # DLRM Criteo shape: recopt vs TorchRec (when .gpu/whl brought it), dims 64/128 x 2048/16384.
  limited "$(budget 150)" python3 benchmarks/bench_gpu.py \
    --out "$out/dlrm.json" --skip-kernels >> "$out/bench.log" 2>&1
  say "dlrm: exit $?"
  # UVM target (issue 17) against an 8 GiB HBM budget: its large set is 12 GiB of managed
  # memory, under what the card has free (more than that can hang the GPU on these hosts).
  limited "$(budget 100)" python3 benchmarks/bench_gpu.py \
    --out "$out/uvm.json" --uvm-only --uvm-hbm-gib 8 >> "$out/bench.log" 2>&1
  say "uvm: exit $?"
  for f in kernels dlrm uvm; do [ -f "$out/$f.md" ] && cat "$out/$f.md"; done
}

idmap() {
  # Id maps (issue 26): the fused step with and without `id_map` on CUDA, 26 x 100k x 64,
  # batch 2048, every stream (the maps on the host, stepped natively); then both steps in
  # the pipeline (batch i+1 remapped on the worker while batch i trains).
  limited "$(budget 70)" python3 benchmarks/bench_id_map.py --device cuda --steps 30 \
    --warmup 5 > "$out/idmap.log" 2>&1
  say "idmap: exit $?"
  limited "$(budget 70)" python3 benchmarks/bench_id_map.py --device cuda --pipeline \
    --remap-threads 4 --steps 30 --warmup 5 >> "$out/idmap.log" 2>&1
  say "idmap pipelined: exit $?"
  # the pipelined remap worker's host time beside its native calls (what holds the GIL)
  limited "$(budget 60)" python3 benchmarks/bench_id_map_worker.py --device cuda \
    --remap-threads 4 --stream drifting worst --steps 60 --warmup 20 >> "$out/idmap.log" 2>&1
  say "idmap worker: exit $?"
  grep -E "^\||^pipelined|host syncs" "$out/idmap.log"
}

# Sourced (tests/test_gpu_session.py): define the functions only.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

case $mode in
  check) check; exit $? ;;
  core | tests | contract | bench | suite | smoke | idmap) setup && "$mode" ;;
  *) echo "usage: $0 check|core|tests|contract|bench|suite|smoke|idmap" >&2; exit 2 ;;
esac
say "done in $(($(date +%s) - start)) s"
