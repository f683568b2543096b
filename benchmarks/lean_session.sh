#!/usr/bin/env bash
# Issue #26 device calls: stages run in order, logs and JSON under $OUT, a short summary printed per stage.
#   tests     the GPU tests of the boundaries and TP=2 paths (GPU_TESTS, GPU_K)
#   profile   benchmarks.profile_step at each TP in PROFILE_TPS (default "4 2"), batches PROFILE_BATCHES
#   ab        the same profile at TP=4 with QWEN35_ALLREDUCE=oneshot (the boundaries before push)
#   record    qwen35.bench --mode record at each TP in RECORD_TPS (RECORD_ARGS; TP=1 only on a GPU of > 100 GB)
#   base      the same at TP=4 from .base/ (a carried snapshot of an earlier commit: `git archive C | tar -x -C .base`)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (the server's and the tokenizer's packages)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU, $(date -u +%FT%TZ)"
devs() { seq -s, 0 $(($1 - 1)); }
prof() {  # prof TP TAG [env...]
  local tp=$1 tag=$2; shift 2
  [ "$tp" -gt "$NGPU" ] && return
  env "$@" CUDA_VISIBLE_DEVICES=$(devs $tp) timeout ${PROFILE_TIMEOUT:-300} torchrun --nproc-per-node "$tp" \
    -m benchmarks.profile_step --decode-batch ${PROFILE_BATCHES:-1,8} --json "$OUT/profile_${tag}_tp$tp.json" \
    > "$OUT/profile_${tag}_tp$tp.log" 2>&1
  echo "profile $tag tp=$tp rc=$?"; grep -E "^===|^--- (deltanet|attention)" "$OUT/profile_${tag}_tp$tp.log"
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest ${GPU_TESTS:-tests/test_push.py tests/test_allreduce.py} -m gpu -q \
        -p no:cacheprovider ${GPU_K:+-k "$GPU_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
    profile) for tp in ${PROFILE_TPS:-4 2}; do prof "$tp" push; done ;;
    ab) prof 4 oneshot QWEN35_ALLREDUCE=oneshot ;;
    base)  # the record at TP=4 of the code in .base/ (a carried snapshot of an earlier commit), same machine
      (cd .base && CUDA_VISIBLE_DEVICES=$(devs 4) PYTHONPATH=$PWD timeout ${RECORD_TIMEOUT:-400} torchrun \
        --nproc-per-node 4 -m qwen35.bench --mode record ${RECORD_ARGS:---batch-sizes 1,8,32,64} \
        --out "$OUT/record_base_tp4.json" > "$OUT/record_base_tp4.log" 2>&1)
      echo "base record tp=4 rc=$?"; grep -v "^\s*$" "$OUT/record_base_tp4.log" | tail -8 ;;
    record)
      big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      for tp in ${RECORD_TPS:-4}; do
        [ "$tp" -gt "$NGPU" ] && continue
        if [ "$tp" -eq 1 ] && [ "$big" -lt 100000 ]; then echo "record tp=1 skipped: the full model needs an H200"; continue; fi
        CUDA_VISIBLE_DEVICES=$(devs $tp) timeout ${RECORD_TIMEOUT:-400} torchrun --nproc-per-node "$tp" -m qwen35.bench \
          --mode record ${RECORD_ARGS:---batch-sizes 1,8,32,64} --out "$OUT/record_tp$tp.json" > "$OUT/record_tp$tp.log" 2>&1
        echo "record tp=$tp rc=$?"; grep -v "^\s*$" "$OUT/record_tp$tp.log" | tail -14
      done ;;
  esac
  echo "[$stage: $(( $(date +%s) - t0 )) s]"
done
