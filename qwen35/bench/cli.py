"""In-engine benchmarks (no HTTP): a static-batch table, a replay of the serving workload, single-request latency,
and the traces correctness harnesses run through create_engine.

    torchrun --nproc-per-node N -m qwen35.bench [--model qwen3.5-35b-a3b --load-format dummy]
        [--mode record,static,trace,latency,spec] [--batch-sizes 1,2,4,...,64] [--input-len 1024] [--output-len 256]
        [--levels 1,2,4,8,16,32,64] [--num-requests 64] [--output-len-dist exp:290,1024|fixed:N|...]
        [--latency-shapes 64:128,2048:256,8192:256] [--compare-hf] [--out results.json]
    torchrun --nproc-per-node N -m qwen35.bench --model llama-1b --mode prefill,decode,mixed [harness flags]

record (the figures of record; qwen35/bench/step_timing.py says how each is measured): per batch size, a decode
  step at context 1024: step ms (CUDA graph, CUDA events), the memory floor (bytes the step moves / copy rate
  measured in the same run), the host time per step outside the forward, and last, kernels per step (eager,
  torch.profiler, which leaves the process's CUDA calls slower: nothing is timed after it); prefill of 1, 8 and 64
  prompts of --input-len tokens. Written to benchmarks/results/<date>_bench_<device>_tp<N>.json. The host time per
  step (cpu_ms) is the engine's own step loop, timed (qwen35/bench/step_timer.py), with overlap unless --no-overlap.
static: for each batch size B, B requests of `--input-len` random tokens generating exactly `--output-len` tokens
  (ignore_eos), all added at once: latency, prefill (input) tok/s, decode (output) tok/s, inter-token latency. Also a
  per-step profile at the smallest and largest batch: step wall time, host time outside the forward, time queueing
  the forward and time waiting for the device.
trace: the closed-loop workload of the serving contract (per level 2 warm-up then `--num-requests` requests, exactly
  c in flight; 1024-token random-text prompts through the chat template, the same prompts at every level), with
  fixed or distributed output lengths (synthetic weights never stop on their own); weighted score as the contract's.
  After the warm level of each concurrency in `--cold-levels`, the same level again with prompts never seen (the
  prefix cache cannot serve them: every prompt is prefilled whole), reported beside it with the cold/warm ratio of
  wall times; the cold levels are not in the score.
latency: one request at a time per shape PROMPT:OUTPUT (qwen35/bench/latency.py), with --compare-hf beside
  transformers' generate on the same weights (TP=1).
spec: speculative decoding per batch size and k (qwen35/bench/spec.py; --load-format dummy-spec for drafts that are
  accepted, --spec-ks 0,1,2,3,auto).
prefill, decode, mixed: the create_engine traces of qwen35/bench/harness.py (batched long-prompt prefill, repeated
  decode over many live requests, a closed loop of prefill/decode/remove calls). They build a LogitsEngine instead of
  the serving engine, so they run in an invocation of their own (both would hold a full KV cache).
Rank 0 drives the engine and prints; the other ranks run the worker loop (or, for the create_engine traces, make
the same calls).
"""
from __future__ import annotations

import argparse
import random

from dist import parallel
from qwen35.bench import harness, latency, spec
from qwen35.bench.args import ENGINE_MODES, HARNESS_MODES, add_bench_args, ints
from qwen35.bench.engine_runs import profile_steps, static_batch
from qwen35.bench.record import record, record_kernel_counts, record_runner_rows
from qwen35.bench.results import default_out, device_name, header, write
from qwen35.bench.trace import trace
from qwen35.engine import EngineArgs, LLMEngine
from scheduler.speculation import max_drafts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="qwen35.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(ap)
    # speculation off unless asked for (--speculative-tokens, --mode spec): the rows of record and the trace are the
    # plain engine's, and random weights' drafts are never accepted
    ap.set_defaults(model="qwen3.5-35b-a3b", load_format="dummy", max_num_seqs=64, speculative_tokens=0)
    add_bench_args(ap)
    for a in ap._actions:  # --model has a default here
        if a.dest == "model":
            a.required = False
    args = ap.parse_args(argv)
    modes = set(args.mode.split(","))
    unknown = modes - set(ENGINE_MODES) - set(HARNESS_MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(sorted(unknown))}: use {', '.join(ENGINE_MODES + HARNESS_MODES)}")
    if modes & set(HARNESS_MODES) and modes & set(ENGINE_MODES):
        raise SystemExit("run the create_engine traces (prefill, decode, mixed) in an invocation of their own: "
                         "both engines would hold a full KV cache")
    eargs = EngineArgs.from_cli(args)
    if "spec" in modes:  # room for the most drafts asked for (the runner's draft buffer)
        ks = spec.parse_ks(args.spec_ks)
        widest = max((max_drafts(k) for k in ks), default=0)
        if widest and max_drafts(eargs.speculative_tokens) < widest:
            eargs.speculative_tokens = "auto" if widest <= max_drafts("auto") else widest
    parallel.init_distributed(eargs.device_type)
    if modes & set(HARNESS_MODES):
        return harness.run(args, eargs, modes, argv)
    if "latency" in modes:
        shapes = latency.parse_shapes(args.latency_shapes)
        if eargs.num_kv_blocks is None and modes == {"latency"}:
            # one request at a time: KV for the longest shape only, which leaves room for transformers' copy
            eargs.max_model_len = eargs.max_model_len or max(p + o for p, o in shapes)
            eargs.num_kv_blocks = 2 * -(-eargs.max_model_len // eargs.block_size)
    engine = LLMEngine(eargs)
    # the runner's rows first, on every rank, while no request holds cache blocks or state slots
    runner_rows = (record_runner_rows(engine.runner, args, engine.args.max_num_batched_tokens)
                   if "record" in modes else None)
    if not parallel.is_driver():
        engine.run_worker_loop()
        if "record" in modes:
            record_kernel_counts(engine.runner, args, None)
        parallel.destroy()
        return
    rng = random.Random(0)
    dev = device_name(engine.runner)
    results = header(eargs, dev, engine.runner, argv)
    out = args.out
    if out is None and modes & {"record", "latency", "spec"}:
        out = default_out("bench" if "record" in modes else "latency" if "latency" in modes else "spec", dev)
    try:
        if "record" in modes:
            record(engine, args, results, runner_rows, rng)
        static_batch(engine, 1, 16, 4, rng)  # warm-up: first-use costs stay out of the table
        if "latency" in modes:
            print(f"latency on {dev}, tp={parallel.tp_size()}, kernels={engine.runner.kernels}, "
                  f"dtype={engine.runner.dtype}, {args.latency_reps} runs per shape (median)")
            results["latency"] = latency.latency(engine, latency.parse_shapes(args.latency_shapes),
                                                 args.latency_reps, args.compare_hf, rng, args.hf_reps)
        if "static" in modes:
            sizes = ints(args.batch_sizes)
            rows = []
            print(f"static batches on {dev}, tp={parallel.tp_size()}")
            print(f"{'batch':>5} {'in':>5} {'out':>5} {'latency s':>10} {'in tok/s':>10} {'out tok/s':>10} {'ITL ms':>8}")
            for b in sizes:
                r = static_batch(engine, b, args.input_len, args.output_len, rng)
                rows.append(r)
                print(f"{b:5d} {r['input_len']:5d} {r['output_len']:5d} {r['latency_s']:10.2f} "
                      f"{r['input_tok_s']:10.0f} {r['output_tok_s']:10.1f} {r['itl_ms']:8.2f}", flush=True)
            results["static"] = rows
            results["profile"] = [profile_steps(engine, b, args.input_len, args.profile_steps, rng)
                                  for b in sorted({sizes[0], sizes[-1]})]
            print(f"{'batch':>5} {'step ms':>8} {'cpu ms':>7} {'fwd queue ms':>13} {'wait ms':>8} {'idle ms':>8}")
            for p in results["profile"]:
                print(f"{p['batch']:5d} {p['step_ms']:8.2f} {p['cpu_ms']:7.3f} {p['forward_queue_ms']:13.3f} "
                      f"{p['wait_ms']:8.2f} {p['gpu_idle_ms']:8.3f}")
        if "spec" in modes:
            print(f"speculative decoding on {dev}, tp={parallel.tp_size()}: prompts of {args.input_len} tokens, "
                  f"{args.output_len} out, temperature 1, load format {eargs.load_format}")
            results.update(spec.spec_rows(engine, ints(args.batch_sizes), spec.parse_ks(args.spec_ks),
                                          args.input_len, args.output_len, rng))
            results["spec_profile"] = [spec.profile_row(engine, int(b), spec.parse_ks(k)[0], args.input_len,
                                                        args.output_len, rng)
                                       for b, k in (item.split(":") for item in args.spec_profile.split(",") if item)]
        if "trace" in modes:
            print(f"trace: {args.num_requests} requests per level, prompts of {args.input_len} tokens, outputs "
                  f"{args.output_len_dist}")
            results["trace"] = trace(engine, args, rng)
            print(f"weighted score {results['trace']['weighted_score']:.0f}")
    finally:
        engine.shutdown()  # (the other ranks leave their loop)
    if "record" in modes:
        record_kernel_counts(engine.runner, args, results["decode"])
    write(out, results)
    parallel.destroy()
