#!/usr/bin/env bash
# One device-machine call: install the carried wheels (.whl/, see README), then run the named stages in order, each
# one's log and JSON under $OUT and a short summary printed (at most 8 files come back from a call: end with pack).
#
#   bash benchmarks/gpu_session.sh tests record spec pack
#
# Stages (settings from the environment; TP defaults to every GPU of the machine; REQUIRE_GPU=H200 runs none
# elsewhere):
#   tests     pytest -m gpu over GPU_TESTS (default tests/), GPU_K a -k filter, TEST_GPUS the visible GPUs; TEST_SPLIT=1
#             on >= 3 GPUs: the files side by side, one GPU each (those with 2-GPU tests on GPUs 0,1)
#   record    qwen35.bench --mode record (decode rows of record, kernels, host time) at each TP in RECORD_TPS;
#             RECORD_ARGS, RECORD_TAG naming its files, RECORD_GPU0 its first GPU (records side by side); TP=1 of
#             the full model only on a GPU of > 100 GB
#   base      the same at TP=RECORD_TPS from .base/ (a carried snapshot of an earlier commit: `git archive C | tar -x
#             -C .base`), for a before/after on one machine
#   profile   benchmarks.profile_step (per layer kind and kernel) at each TP in PROFILE_TPS, PROFILE_BATCHES,
#             PROFILE_TAG, PROFILE_ENV (e.g. QWEN35_ALLREDUCE=oneshot for the boundaries before push)
#   spec      qwen35.bench --mode spec (dummy-spec weights, acceptance 0.6) at SPEC_TP; SPEC_ARGS, SPEC_TAG
#   basespec  the same from .base/ (basespec_tpN.json)
#   dense     issue #29: benchmarks.profile_decode_calls, then the llama-1b and llama-3b create_engine traces
#   sweep     benchmarks.sweep_decode_attention
#   tune      benchmarks.tune_moe, each job of TUNE_JOBS ("TP" or "TP:T,T,...", default every GPU's TP) on a GPU of
#             its own, side by side (TUNE_ARGS, default --quick; " " for the full grid), each changed decode bucket
#             confirmed against the table's entry, their changes merged into $OUT/moe_configs.json
#   usetuned  copy $OUT/moe_configs.json over layers/moe_configs.json (the stages after it use the new tiles)
#   kernels   each benchmarks/bench_<layer>.py micro-benchmark
#   mixed     benchmarks.profile_mixed_host at TP=NGPU (MIXED_ARGS, default all 40 layers): the host's queueing time of
#             the eager steps that admit a request, against their device time
#   parity    benchmarks.gpu_parity (bf16 against transformers' fp32) at TP=1 and TP=NGPU
#   latency   qwen35.bench --mode latency --compare-hf on qwen3.5-4b, one GPU
#   host      qwen35.bench.host_time --breakdown (HOST_ARGS) and benchmarks.bench_host_calls
#   server    ./start.sh at TP=NGPU (SERVER_ARGS), then benchmarks.throughput (THROUGHPUT_ARGS: the users' levels,
#             standard exp:290,1024 lengths); speculation off (random weights' drafts are never accepted: specserver
#             measures it)
#   baseserver  the same from .base/ (throughput_base_tpN.json): `base record baseserver server` is a before/after
#             of the decode rows and the HTTP score on one machine
#   specserver  the HTTP workload on dummy-spec weights (acceptance 0.6) without speculation, then with
#             --speculative-tokens SPEC_SERVER_K (default auto): throughput_spec_k{0,K}_tpN.json, one machine
#   sideserver  two TP=1 servers side by side, A on GPU 0 and B on GPU 1 of a 2-GPU machine, each with the HTTP
#             workload: ~370 s of wall time where one after the other took ~590 (2026-11-30: TP=1 `auto` with two
#             cost tables, one call). SIDE_A_ARGS / SIDE_B_ARGS their server flags (default: dummy-spec weights at
#             acceptance 0.6, speculation off for A and auto for B), SIDE_A_TREE=.base runs A from .base/ (a
#             before/after of a change), SIDE_MODEL (default qwen3.5-35b-a3b): throughput_side_{a,b}.json
#   pack      everything under $OUT but the JSON files into $OUT/logs.tgz
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the server's and the tokenizer's packages, installed once per machine
  [ -d /tmp/site/orjson ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
DEV="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU"
echo "device: $DEV, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)"
if [ -n "${REQUIRE_GPU:-}" ] && [[ "$DEV" != *"$REQUIRE_GPU"* ]]; then  # timings of record need that card: stop early
  echo "not a $REQUIRE_GPU machine: no stage run"; exit 3
fi
devs() { seq -s, ${2:-0} $((${2:-0} + $1 - 1)); }           # devs N [FIRST]: N visible GPUs from FIRST
port() { echo $((29500 + ${1:-0} * 7 + RANDOM % 5)); }     # a torchrun port per first GPU (stages side by side)
run_tp() {  # run_tp TP FIRST_GPU TIMEOUT LOG -m module args...: torchrun on TP GPUs, output to LOG
  local tp=$1 g0=$2 limit=$3 log=$4; shift 4
  CUDA_VISIBLE_DEVICES=$(devs "$tp" "$g0") timeout "$limit" torchrun --nproc-per-node "$tp" --master-port $(port "$g0") \
    "$@" > "$log" 2>&1
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    tests)
      gpu_tests() {  # gpu_tests VISIBLE_GPUS TAG FILES...
        local vis=$1 tag=$2; shift 2
        CUDA_VISIBLE_DEVICES=$vis timeout ${TESTS_TIMEOUT:-500} python3 -m pytest "$@" -m gpu -q -p no:cacheprovider \
          ${GPU_K:+-k "$GPU_K"} > "$OUT/gpu_tests${TEST_TAG:-}$tag.log" 2>&1
        echo "gpu tests$tag on GPU $vis: $(tail -1 "$OUT/gpu_tests${TEST_TAG:-}$tag.log")"
      }
      if [ -n "${TEST_SPLIT:-}" ] && [ "$NGPU" -ge 3 ]; then
        # every test on one GPU, as on a 1-GPU machine, the files spread over GPUs 2.. side by side; the files with
        # 2-GPU tests on GPUs 0,1 (largest files first, each to the least loaded GPU by bytes)
        files=$(ls ${GPU_TESTS:-tests/test_*.py}); two=$(grep -l "device_count() < 2" $files); one=()
        declare -A load=(); for g in $(seq 2 $((NGPU - 1))); do load[$g]=0; done
        for f in $(ls -S $(grep -L "device_count() < 2" $(grep -l "mark.gpu" $files))); do
          best=2; for g in "${!load[@]}"; do [ "${load[$g]}" -lt "${load[$best]}" ] && best=$g; done
          load[$best]=$(( ${load[$best]} + $(stat -c %s "$f") )); one[$best]="${one[$best]:-} $f"
        done
        gpu_tests 0,1 _gpu01 $two &
        for g in "${!load[@]}"; do gpu_tests "$g" "_gpu$g" ${one[$g]} & done
        wait
      else
        gpu_tests "${TEST_GPUS:-$(devs $NGPU)}" "" ${GPU_TESTS:-tests/}; tail -8 "$OUT/gpu_tests${TEST_TAG:-}.log"
      fi ;;
    record|base)
      big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      g0=${RECORD_GPU0:-0}
      for tp in ${RECORD_TPS:-$NGPU}; do
        [ $((g0 + tp)) -gt "$NGPU" ] && continue
        if [ "$tp" -eq 1 ] && [ "$big" -lt 100000 ]; then echo "record tp=1 skipped: the full model needs an H200"; continue; fi
        f="$OUT/${stage}${RECORD_TAG:+_${RECORD_TAG}}_tp$tp"
        if [ "$stage" = base ]; then
          (cd .base && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} run_tp "$tp" "$g0" ${RECORD_TIMEOUT:-400} "$f.log" \
            -m qwen35.bench --mode record ${RECORD_ARGS:---batch-sizes 1,8,32,64} --out "$f.json")
        else
          run_tp "$tp" "$g0" ${RECORD_TIMEOUT:-400} "$f.log" -m qwen35.bench --mode record \
            ${RECORD_ARGS:---batch-sizes 1,8,32,64} --out "$f.json"
        fi
        echo "$stage ${RECORD_TAG:-} tp=$tp rc=$?"; grep -v "^\s*$" "$f.log" | tail -14
      done ;;
    profile)
      for tp in ${PROFILE_TPS:-$NGPU}; do
        [ "$tp" -gt "$NGPU" ] && continue
        f="$OUT/profile${PROFILE_TAG:+_${PROFILE_TAG}}_tp$tp"
        ( [ -n "${PROFILE_ENV:-}" ] && export ${PROFILE_ENV}
          run_tp "$tp" 0 ${PROFILE_TIMEOUT:-300} "$f.log" -m benchmarks.profile_step \
            --decode-batch ${PROFILE_BATCHES:-1,8} --json "$f.json" )
        echo "profile tp=$tp rc=$?"; grep -E "^===|^--- (deltanet|attention)" "$f.log"
      done ;;
    spec|basespec)
      tp=${SPEC_TP:-$NGPU}; f="$OUT/${stage}${SPEC_TAG:+_${SPEC_TAG}}_tp$tp"; tree=$PWD
      [ "$stage" = basespec ] && tree=$PWD/.base
      (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} run_tp "$tp" 0 ${SPEC_TIMEOUT:-400} "$f.log" \
        -m qwen35.bench --mode spec --load-format dummy-spec --spec-acceptance 0.6 \
        ${SPEC_ARGS:---batch-sizes 1,8,64 --spec-ks 0,1,2 --output-len 64} --out "$f.json")
      echo "$stage tp=$tp rc=$?"; grep -E "^ *[0-9]+ +[0-9a-z]+ +[0-9.]+ |^---|us/step|captured|Error|error" "$f.log" | head -120 ;;
    dense)
      g=${DENSE_GPU:-0}
      CUDA_VISIBLE_DEVICES=$g timeout 200 python3 -m benchmarks.profile_decode_calls --json "$OUT/dense_profile.json" \
        > "$OUT/dense_profile.log" 2>&1; echo "dense profile rc=$?"; head -60 "$OUT/dense_profile.log"
      for m in llama-1b llama-3b; do
        run_tp 1 "$g" 300 "$OUT/dense_harness_$m.log" -m qwen35.bench --model $m --mode prefill,decode,mixed \
          --out "$OUT/dense_harness_$m.json"
        echo "dense harness $m rc=$?"; grep -E "prefill|decode|mixed|create" "$OUT/dense_harness_$m.log" | tail -14
      done ;;
    sweep)
      CUDA_VISIBLE_DEVICES=${SWEEP_GPU:-0} timeout ${SWEEP_TIMEOUT:-300} python3 -m benchmarks.sweep_decode_attention \
        --json "$OUT/sweep_decode.json" > "$OUT/sweep_decode.log" 2>&1; echo "sweep rc=$?"; grep -v "^\s*$" "$OUT/sweep_decode.log" | tail -16 ;;
    tune)  # one job a GPU, side by side (GPU i takes the i-th job), then their changes merged into one table
      [ -f "$OUT/moe_configs.json" ] || cp layers/moe_configs.json "$OUT/moe_configs.json"
      i=0; tuned=()
      for job in ${TUNE_JOBS:-$NGPU}; do
        [ "$i" -gt 0 ] && [ $((i % NGPU)) -eq 0 ] && wait  # more jobs than GPUs: in waves (never two on one GPU)
        g=$((i % NGPU)); tp=${job%%:*}; name="tp${job//[:,]/_}"; batches=()
        [ "$job" != "$tp" ] && batches=(--batches ${job#*:}) && batches=(${batches[@]//,/ })
        cp "$OUT/moe_configs.json" "$OUT/moe_$name.json"; tuned+=("$OUT/moe_$name.json")
        CUDA_VISIBLE_DEVICES=$g timeout ${TUNE_TIMEOUT:-330} python3 -m benchmarks.tune_moe --tp "$tp" \
          ${TUNE_ARGS:---quick} "${batches[@]}" --out "$OUT/moe_$name.json" > "$OUT/tune_$name.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      python3 -m benchmarks.tune_moe --merge "${tuned[@]}" --out "$OUT/moe_configs.json"
      rm -f "${tuned[@]}"
      for f in "$OUT"/tune_tp*.log; do echo "$(basename "$f" .log)"; grep -E "gemv .*scan|gate_up_gemv|confirm" "$f" | cut -c1-160; done ;;
    usetuned) cp "$OUT/moe_configs.json" layers/moe_configs.json && echo "layers/moe_configs.json replaced" ;;
    kernels)
      for b in benchmarks/bench_*.py; do CUDA_VISIBLE_DEVICES=0 python3 -m "benchmarks.$(basename "$b" .py)" 2>&1 | tail -30; done ;;
    mixed)
      run_tp "$NGPU" 0 ${MIXED_TIMEOUT:-300} "$OUT/mixed_host_tp$NGPU.log" -m benchmarks.profile_mixed_host \
        ${MIXED_ARGS:---layers 40} --json "$OUT/mixed_host_tp$NGPU.json"
      echo "mixed tp=$NGPU rc=$?"; grep -E "^ *(prefill|mixed):|step +queue" "$OUT/mixed_host_tp$NGPU.log" ;;
    parity)
      CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.gpu_parity --layers 8 --out "$OUT/parity_tp1.json" 2>&1 \
        | grep -v "falling back" | tail -5
      if [ "$NGPU" -gt 1 ]; then
        run_tp "$NGPU" 0 400 "$OUT/parity_tp$NGPU.log" -m benchmarks.gpu_parity --layers 8 --out "$OUT/parity_tp$NGPU.json"
        grep -v "falling back" "$OUT/parity_tp$NGPU.log" | tail -5
      fi ;;
    latency)
      CUDA_VISIBLE_DEVICES=0 python3 -m qwen35.bench --model qwen3.5-4b --mode latency --compare-hf \
        ${LATENCY_ARGS:-} --out "$OUT/latency_qwen3.5-4b_tp1.json" 2>&1 | grep -v "falling back" | tail -8 ;;
    host)
      CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_host_calls 2>&1 | tail -4
      CUDA_VISIBLE_DEVICES=0 python3 -m qwen35.bench.host_time --device cuda --model qwen3.5-35b-a3b --load-format dummy \
        ${HOST_ARGS:---batch-sizes 1,8,32,64 --steps 100 --reps 3 --breakdown} 2>&1 | grep "^{" | tee "$OUT/host.log" ;;
    server|baseserver)
      tag=${stage%server}; tree=$PWD; [ -n "$tag" ] && tree=$PWD/.base
      (cd "$tree" && export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH}
        ./start.sh --port 8000 --model qwen3.5-35b-a3b --load-format dummy --speculative-tokens 0 --tp "$NGPU" \
          --log "$OUT/${tag}server.log" --timeout 600 ${SERVER_ARGS:-} || { tail -30 "$OUT/${tag}server.log"; exit 1; }
        python3 -m benchmarks.throughput --url http://127.0.0.1:8000 \
          ${THROUGHPUT_ARGS:---levels 1,2,4,8,16,32,64 --num-requests 64 --ignore-eos} \
          --device-info "$DEV, TP=$NGPU, dummy weights" --out "$OUT/throughput${tag:+_$tag}_tp$NGPU.json" 2>&1 | tail -14
        ./start.sh --stop --port 8000) ;;
    specserver)  # speculation served: the same workload against a server without it and one with SPEC_SERVER_K
      for k in 0 ${SPEC_SERVER_K:-auto}; do
        ./start.sh --port 8000 --model qwen3.5-35b-a3b --load-format dummy-spec --spec-acceptance 0.6 \
          --speculative-tokens "$k" --tp "$NGPU" --log "$OUT/specserver_k$k.log" --timeout 600 ${SERVER_ARGS:-} \
          || { tail -30 "$OUT/specserver_k$k.log"; exit 1; }
        python3 -m benchmarks.throughput --url http://127.0.0.1:8000 \
          ${THROUGHPUT_ARGS:---levels 1,2,4,8,16,32,64 --num-requests 64 --ignore-eos} \
          --device-info "$DEV, TP=$NGPU, dummy-spec weights (acceptance 0.6), --speculative-tokens $k" \
          --out "$OUT/throughput_spec_k${k}_tp$NGPU.json" 2>&1 | tail -6
        grep -c "compiled a kernel after start" "$OUT/specserver_k$k.log" | sed 's/^/Triton compiles after start: /'
        ./start.sh --stop --port 8000
      done ;;
    sideserver)
      side() {  # side NAME GPU PORT TREE ARGS...: one TP=1 server on one GPU and the workload against it
        local name=$1 g=$2 p=$3 tree=$4; shift 4
        (cd "$tree" && export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES=$g
         ./start.sh --port "$p" --model "${SIDE_MODEL:-qwen3.5-35b-a3b}" --tp 1 "$@" --log "$OUT/side_$name.log" \
           --timeout 600 >/dev/null || { tail -20 "$OUT/side_$name.log"; exit 1; }
         python3 -m benchmarks.throughput --url "http://127.0.0.1:$p" \
           ${THROUGHPUT_ARGS:---levels 1,2,4,8,16,32,64 --num-requests 64 --ignore-eos} \
           --device-info "$DEV, GPU $g, TP=1, side by side with another server: $*" \
           --out "$OUT/throughput_side_$name.json" > "$OUT/side_${name}_client.log" 2>&1
         echo "side $name: $(grep -c "compiled a kernel after start" "$OUT/side_$name.log") Triton compiles after start"
         ./start.sh --stop --port "$p" >/dev/null)
      }
      spec="--load-format dummy-spec --spec-acceptance 0.6"
      side a 0 8000 "$PWD/${SIDE_A_TREE:-.}" ${SIDE_A_ARGS:-$spec --speculative-tokens 0} &
      side b 1 8001 "$PWD" ${SIDE_B_ARGS:-$spec --speculative-tokens auto} &
      wait
      for name in a b; do echo "== $name"; tail -9 "$OUT/side_${name}_client.log"; done ;;
    pack) (cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz $(ls | grep -v '\.json$') \
             && ls | grep -v -e '\.json$' -e '^logs.tgz$' | xargs -r rm -rf) ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "[$stage: $(( $(date +%s) - t0 )) s]"
done
