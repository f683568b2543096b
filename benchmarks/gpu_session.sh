#!/usr/bin/env bash
# One device-machine call: install the carried wheels, then run the named GPU stages, logs under $OUT.
#
#   bash benchmarks/gpu_session.sh tests parity bench server
#
# Stages: profile (benchmarks.profile_step: top kernels per phase, PROFILE_ARGS), tune (benchmarks.tune_moe:
# writes layers/moe_configs.json, copied to $OUT; TUNE_TP), record (qwen35.bench --mode record: the decode/prefill rows of record, RECORD_ARGS), kernels (each
# benchmarks/bench_<layer>.py micro-benchmark), tests (pytest -m gpu over GPU_TESTS, default tests/), parity (benchmarks.gpu_parity at TP=1 and TP=NGPU), bench (qwen35.bench at TP=NGPU
# and TP=1, full-size dummy weights), latency and harness (issue #11: qwen35.bench --mode latency --compare-hf on
# qwen3.5-4b; --mode prefill,decode,mixed on llama-1b; one GPU each), host (issue #10: qwen35.bench.host_time --breakdown
# and benchmarks.bench_host_calls, HOST_ARGS), server (start.sh at TP=NGPU +
# benchmarks.throughput). Sizes come from the
# environment (BENCH_ARGS, TRACE_ARGS, THROUGHPUT_ARGS) so that one call fits the device time at hand.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
NGPU=$(nvidia-smi -L | wc -l)
DEV="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU"
echo "device: $DEV, $(date -u +%FT%TZ)"
BENCH_ARGS=${BENCH_ARGS:---mode static --batch-sizes 1,2,4,8,16,32,64 --input-len 1024 --output-len 64}
THROUGHPUT_ARGS=${THROUGHPUT_ARGS:---levels 1,2,4,8,16,32,64 --num-requests 64 --ignore-eos}  # standard exp:290,1024 lengths

for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    record)
      torchrun --nproc-per-node "$NGPU" -m qwen35.bench --mode record ${RECORD_ARGS:-} --out "$OUT/record_tp$NGPU.json" \
        2>&1 | grep -v "^\s*$" | tail -16 ;;
    trace)  # issue #9: a warm c=64 level (prompts seen at c=32) beside a cold one (prompts never seen)
      torchrun --nproc-per-node "$NGPU" -m qwen35.bench --mode trace ${TRACE_ARGS:---levels 32,64 --cold-levels 64} \
        --max-num-seqs 64 --out "$OUT/trace_tp$NGPU.json" 2>&1 | grep -v "^\s*$" | tail -8 ;;
    kernels)
      for b in benchmarks/bench_*.py; do python3 -m "benchmarks.$(basename "$b" .py)" 2>&1 | tail -30; done ;;
    tests)
      python3 -m pytest ${GPU_TESTS:-tests/} -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    parity)
      CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.gpu_parity --layers 8 --out "$OUT/parity_tp1.json" 2>&1 \
        | grep -v "falling back" | tail -5
      if [ "$NGPU" -gt 1 ]; then
        torchrun --nproc-per-node "$NGPU" -m benchmarks.gpu_parity --layers 8 --out "$OUT/parity_tp$NGPU.json" \
          2>&1 | grep -v "falling back" | tail -5
      fi ;;
    bench)
      torchrun --nproc-per-node "$NGPU" -m qwen35.bench $BENCH_ARGS --out "$OUT/bench_tp$NGPU.json" 2>&1 \
        | grep -v "^\s*$" | tail -22
      if [ "$NGPU" -gt 1 ] && [ -n "${BENCH_TP1:-1}" ]; then
        CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 1 -m qwen35.bench $BENCH_ARGS --out "$OUT/bench_tp1.json" \
          2>&1 | tail -14
      fi ;;
    latency)  # issue #11: Qwen3.5-4B one request at a time, beside transformers' generate, one GPU
      CUDA_VISIBLE_DEVICES=0 python3 -m qwen35.bench --model qwen3.5-4b --mode latency --compare-hf \
        ${LATENCY_ARGS:-} --out "$OUT/latency_qwen3.5-4b_tp1.json" 2>&1 | grep -v "falling back" | tail -8 ;;
    harness)  # issue #11: the create_engine traces on a ~1B Llama, one GPU
      CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 1 -m qwen35.bench --model llama-1b \
        --mode prefill,decode,mixed ${HARNESS_ARGS:-} --out "$OUT/harness_llama-1b_tp1.json" 2>&1 | tail -14 ;;
    server)
      ./start.sh --port 8000 --model qwen3.5-35b-a3b --load-format dummy --tp "$NGPU" --log "$OUT/server.log" \
        --timeout 600 ${SERVER_ARGS:-} || { tail -30 "$OUT/server.log"; continue; }
      python3 -m benchmarks.throughput --url http://127.0.0.1:8000 $THROUGHPUT_ARGS \
        --device-info "$DEV, TP=$NGPU, dummy weights" --out "$OUT/throughput_tp$NGPU.json" 2>&1 | tail -14
      ./start.sh --stop --port 8000 ;;
    host)  # issue #10: the host time per decode step split into phases, and what each CUDA call of a step costs
      python3 -m benchmarks.bench_host_calls 2>&1 | tail -4
      python3 -m qwen35.bench.host_time --device cuda --model qwen3.5-35b-a3b --load-format dummy \
        ${HOST_ARGS:---batch-sizes 1,8,32,64 --steps 100 --reps 3 --breakdown} 2>&1 | grep "^{" | tee "$OUT/host.log" ;;
    profile)
      python3 -m benchmarks.profile_step ${PROFILE_ARGS:---decode-batch 1,8,64 --top 30} 2>&1 | tee "$OUT/profile.log" \
        | grep -v "^\s*$" | tail -120 ;;
    tune)
      # decode buckets over the full tile grid, prefill buckets over the quick one; the table is written after each TP
      timeout "${TUNE_TIMEOUT:-400}" python3 -m benchmarks.tune_moe --tp ${TUNE_TP:-1 8} --batches 1 2 4 8 16 32 64 128 \
        2>&1 | tee "$OUT/tune.log" | grep -E "wrote|TP=" ; \
      timeout "${TUNE_TIMEOUT:-400}" python3 -m benchmarks.tune_moe --tp ${TUNE_TP:-1 8} --quick \
        --batches 256 512 1024 2048 4096 8192 2>&1 | tee -a "$OUT/tune.log" | grep -E "wrote|TP="
      cp layers/moe_configs.json "$OUT/" 2>/dev/null ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "stage $stage: $(( $(date +%s) - t0 )) s"
done
