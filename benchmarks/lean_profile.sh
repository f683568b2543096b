#!/usr/bin/env bash
# One device call for issue #26: benchmarks.profile_step at TP=1 (needs an H200 for the full model), TP=2 and
# TP=4 on the GPUs present (batch sizes PROFILE_BATCHES, default 1,8); JSON and logs under $OUT; summaries last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)"
TAG=${TAG:-now}
for tp in ${PROFILE_TPS:-4 2 1}; do
  [ "$tp" -gt "$NGPU" ] && continue
  devs=$(seq -s, 0 $((tp - 1)))
  CUDA_VISIBLE_DEVICES=$devs timeout ${PROFILE_TIMEOUT:-300} torchrun --nproc-per-node "$tp" -m benchmarks.profile_step \
    --decode-batch ${PROFILE_BATCHES:-1,8} --json "$OUT/profile_${TAG}_tp$tp.json" ${PROFILE_ARGS:-} \
    > "$OUT/profile_${TAG}_tp$tp.log" 2>&1
  echo "tp=$tp rc=$?"; grep -E "^===|^---|^ " "$OUT/profile_${TAG}_tp$tp.log" | head -60
done
