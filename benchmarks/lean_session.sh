#!/usr/bin/env bash
# Issue #26 device calls: stages run in order, logs and JSON under $OUT, a short summary printed per stage.
#   tests     the GPU tests of the boundaries and TP=2 paths (GPU_TESTS, GPU_K)
#   profile   benchmarks.profile_step at each TP in PROFILE_TPS (default "4 2"), batches PROFILE_BATCHES
#   ab        the same profile at TP=4 with QWEN35_ALLREDUCE=oneshot (the boundaries before push)
#   record    qwen35.bench --mode record at each TP in RECORD_TPS (RECORD_ARGS; TP=1 only on a GPU of > 100 GB)
#   base      the same at TP=4 from .base/ (a carried snapshot of an earlier commit: `git archive C | tar -x -C .base`)
#   tune      benchmarks.tune_moe (TUNE_TPS, default "4 2"; --quick) on GPU TUNE_GPU into $OUT/moe_configs.json
#   pack      everything under $OUT but the JSON files into $OUT/logs.tgz (at most 8 files come back from a call)
#   usetuned  copy $OUT/moe_configs.json over layers/moe_configs.json (the records after it use the new tiles)
#   dense     issue #29: benchmarks.profile_decode_calls and the llama-1b / llama-3b create_engine traces on GPU DENSE_GPU
#   sweep     issue #29: benchmarks.sweep_decode_attention on GPU SWEEP_GPU
#   spec      issue #28: qwen35.bench --mode spec (dummy-spec weights, acceptance 0.6) at TP SPEC_TP (default 4),
#             SPEC_ARGS (batches, ks, --spec-profile), SPEC_TAG naming its files
# RECORD_GPU0: the first GPU of a record (several stages may run side by side on one machine); RECORD_TAG names its
# files; each torchrun takes its own port.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (the server's and the tokenizer's packages), installed once
  [ -d /tmp/site/orjson ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU, $(date -u +%FT%TZ)"
devs() { seq -s, ${2:-0} $((${2:-0} + $1 - 1)); }
port() { echo $((29500 + ${1:-0} * 7 + RANDOM % 5)); }
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
      CUDA_VISIBLE_DEVICES=${TEST_GPUS:-$(devs $NGPU)} timeout ${TESTS_TIMEOUT:-300} python3 -m pytest ${GPU_TESTS:-tests/test_push.py tests/test_allreduce.py} -m gpu -q \
        -p no:cacheprovider ${GPU_K:+-k "$GPU_K"} 2>&1 | tee "$OUT/gpu_tests${TEST_TAG:-}.log" | tail -8 ;;
    profile) for tp in ${PROFILE_TPS:-4 2}; do prof "$tp" push; done ;;
    ab) prof 4 oneshot QWEN35_ALLREDUCE=oneshot ;;
    base)  # the record at TP=4 of the code in .base/ (a carried snapshot of an earlier commit), same machine
      (cd .base && CUDA_VISIBLE_DEVICES=$(devs 4) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout ${RECORD_TIMEOUT:-400} torchrun \
        --nproc-per-node 4 -m qwen35.bench --mode record ${RECORD_ARGS:---batch-sizes 1,8,32,64} \
        --out "$OUT/record_base_tp4.json" > "$OUT/record_base_tp4.log" 2>&1)
      echo "base record tp=4 rc=$?"; grep -v "^\s*$" "$OUT/record_base_tp4.log" | tail -8 ;;
    record)
      big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      g0=${RECORD_GPU0:-0}
      for tp in ${RECORD_TPS:-4}; do
        [ $((g0 + tp)) -gt "$NGPU" ] && continue
        if [ "$tp" -eq 1 ] && [ "$big" -lt 100000 ]; then echo "record tp=1 skipped: the full model needs an H200"; continue; fi
        f="$OUT/record${RECORD_TAG:+_${RECORD_TAG}}_tp$tp"
        CUDA_VISIBLE_DEVICES=$(devs $tp $g0) timeout ${RECORD_TIMEOUT:-400} torchrun --nproc-per-node "$tp" \
          --master-port $(port $g0) -m qwen35.bench --mode record ${RECORD_ARGS:---batch-sizes 1,8,32,64} \
          --out "$f.json" > "$f.log" 2>&1
        echo "record ${RECORD_TAG:-} tp=$tp rc=$?"; grep -v "^\s*$" "$f.log" | tail -14
      done ;;
    tune)
      [ -f "$OUT/moe_configs.json" ] || cp layers/moe_configs.json "$OUT/moe_configs.json"
      CUDA_VISIBLE_DEVICES=${TUNE_GPU:-0} timeout ${TUNE_TIMEOUT:-330} python3 -m benchmarks.tune_moe \
        --tp ${TUNE_TPS:-4 2} ${TUNE_ARGS:---quick} --out "$OUT/moe_configs.json" > "$OUT/tune.log" 2>&1
      echo "tune rc=$?"; grep -E "TP=|gemv " "$OUT/tune.log" | tail -20 ;;
    pack) (cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz $(ls | grep -v '\.json$') && ls | grep -v -e '\.json$' -e '^logs.tgz$' | xargs -r rm -rf) ;;
    usetuned) cp "$OUT/moe_configs.json" layers/moe_configs.json && echo "layers/moe_configs.json replaced" ;;
    dense)
      g=${DENSE_GPU:-0}
      CUDA_VISIBLE_DEVICES=$g timeout 200 python3 -m benchmarks.profile_decode_calls --json "$OUT/dense_profile.json" \
        > "$OUT/dense_profile.log" 2>&1; echo "dense profile rc=$?"; head -60 "$OUT/dense_profile.log"
      CUDA_VISIBLE_DEVICES=$g timeout 300 torchrun --nproc-per-node 1 --master-port $(port $g) -m qwen35.bench \
        --model llama-1b --mode prefill,decode,mixed --out "$OUT/dense_harness.json" > "$OUT/dense_harness.log" 2>&1
      echo "dense harness rc=$?"; grep -E "prefill|decode|mixed|create" "$OUT/dense_harness.log" | tail -14
      CUDA_VISIBLE_DEVICES=$g timeout 300 torchrun --nproc-per-node 1 --master-port $(port $g) -m qwen35.bench \
        --model llama-3b --mode prefill,decode,mixed --out "$OUT/dense_harness_3b.json" > "$OUT/dense_harness_3b.log" 2>&1
      echo "dense harness 3b rc=$?"; grep -E "prefill|decode|mixed|create" "$OUT/dense_harness_3b.log" | tail -14 ;;
    sweep)
      CUDA_VISIBLE_DEVICES=${SWEEP_GPU:-0} timeout ${SWEEP_TIMEOUT:-300} python3 -m benchmarks.sweep_decode_attention \
        --json "$OUT/sweep_decode.json" > "$OUT/sweep_decode.log" 2>&1; echo "sweep rc=$?"; grep -v "^\s*$" "$OUT/sweep_decode.log" | tail -16 ;;
    spec)
      tp=${SPEC_TP:-4}; f="$OUT/spec${SPEC_TAG:+_${SPEC_TAG}}_tp$tp"
      CUDA_VISIBLE_DEVICES=$(devs $tp) timeout ${SPEC_TIMEOUT:-400} torchrun --nproc-per-node "$tp" --master-port $(port 0) \
        -m qwen35.bench --mode spec --load-format dummy-spec --spec-acceptance 0.6 \
        ${SPEC_ARGS:---batch-sizes 1,8,64 --spec-ks 0,1,2 --output-len 64} --out "$f.json" > "$f.log" 2>&1
      echo "spec tp=$tp rc=$?"; grep -E "^ *[0-9]+ +[0-9a-z]+ +[0-9.]+ |^---|us/step|captured|Error|error" "$f.log" | head -120 ;;
  esac
  echo "[$stage: $(( $(date +%s) - t0 )) s]"
done
