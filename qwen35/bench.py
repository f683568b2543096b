"""In-engine benchmarks (no HTTP): a static-batch table, a replay of the serving workload, single-request latency,
and the traces correctness harnesses run through create_engine.

    torchrun --nproc-per-node N -m qwen35.bench [--model qwen3.5-35b-a3b --load-format dummy]
        [--mode record,static,trace,latency] [--batch-sizes 1,2,4,...,64] [--input-len 1024] [--output-len 256]
        [--levels 1,2,4,8,16,32,64] [--num-requests 64] [--output-len-dist exp:290,1024|fixed:N|...]
        [--latency-shapes 64:128,2048:256,8192:256] [--compare-hf] [--out results.json]
    torchrun --nproc-per-node N -m qwen35.bench --model llama-1b --mode prefill,decode,mixed [harness flags]

record (the figures of record; qwen35/step_timing.py says how each is measured): per batch size, a decode step at
  context 1024: step ms (CUDA graph, CUDA events), the memory floor (bytes the step moves / copy rate measured in
  the same run), the host time per step outside the forward, and last, kernels per step (eager, torch.profiler,
  which leaves the process's CUDA calls slower: nothing is timed after it); prefill of 1, 8 and 64 prompts of
  --input-len tokens. Written to benchmarks/results/<date>_bench_<device>_tp<N>.json. The
  host time per step (cpu_ms) is the engine's own measure (LLMEngine.times), with overlap unless --no-overlap.
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
latency: one request at a time per shape PROMPT:OUTPUT (qwen35/latency.py), with --compare-hf beside
  transformers' generate on the same weights (TP=1).
prefill, decode, mixed: the create_engine traces of qwen35/harness.py (batched long-prompt prefill, repeated decode
  over many live requests, a closed loop of prefill/decode/remove calls). They build a LogitsEngine instead of the
  serving engine, so they run in an invocation of their own (both would hold a full KV cache).
Rank 0 drives the engine and prints; the other ranks run the worker loop (or, for the create_engine traces, make
the same calls).
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from types import SimpleNamespace

import torch

from dist import parallel
from qwen35 import harness, latency, step_timing, workload
from qwen35.engine import EngineArgs, LLMEngine, StepTimes
from scheduler.sampling_params import SamplingParams

WEIGHTS = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}
ENGINE_MODES = ("record", "static", "trace", "latency")
HARNESS_MODES = ("prefill", "decode", "mixed")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def run_to_completion(engine: LLMEngine) -> dict[str, dict]:
    """Step until every request finished; per request: first-token time and finish time (perf_counter)."""
    seen: dict[str, dict] = {}
    get = seen.get
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rec = get(o.request_id)
            if rec is None:  # (setdefault would build a dict per output)
                rec = seen[o.request_id] = {"first": now, "tokens": 0}
            rec["tokens"] = o.num_completion_tokens
            if o.finished:
                rec["done"] = now
    return seen


def _vocab(engine: LLMEngine) -> int:
    """Random prompt ids: ordinary tokens of the tokenizer that the model's vocabulary also has."""
    return min(engine.tokenizer.num_real_tokens - 33, engine.config.vocab_size)


def static_batch(engine: LLMEngine, batch: int, input_len: int, output_len: int, rng: random.Random) -> dict:
    vocab = _vocab(engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"static-{batch}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    t0 = time.perf_counter()
    seen = run_to_completion(engine)
    end = max(r["done"] for r in seen.values())
    first = max(r["first"] for r in seen.values())  # every prompt prefilled and its first token out
    decode_s = end - first
    return {
        "batch": batch, "input_len": input_len, "output_len": output_len, "latency_s": end - t0,
        "input_tok_s": batch * input_len / (first - t0),
        "output_tok_s": batch * (output_len - 1) / decode_s if decode_s > 0 else 0.0,
        "itl_ms": 1e3 * decode_s / max(1, output_len - 1),
    }


def profile_steps(engine: LLMEngine, batch: int, input_len: int, decode_steps: int, rng: random.Random,
                  stream: bool = True) -> dict:
    """Mean per decode step at `batch`, as the engine measures its own steps (StepTimes): wall time per step, host
    time outside the forward (cpu_ms: scheduling, the plan broadcast, sampling, postprocess; with overlap it runs
    while the device computes), time queueing the forward, time the host waited for the device's tokens, and on a
    GPU the time the device sat idle between steps (gpu_idle_ms: the host time the overlap did not hide)."""
    vocab = _vocab(engine)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params, stream)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill first, untimed
        engine.step()
    engine.times = StepTimes()
    t0 = time.perf_counter()
    run_to_completion(engine)
    wall, t = time.perf_counter() - t0, engine.times
    n = max(1, t.steps)
    return {"batch": batch, "steps": t.steps, "overlap": engine.overlap, "step_ms": 1e3 * wall / n,
            "cpu_ms": 1e3 * t.host_s / n, "forward_queue_ms": 1e3 * t.forward_s / n, "wait_ms": 1e3 * t.wait_s / n,
            "gpu_idle_ms": 1e3 * t.gpu_idle_s / t.gpu_gaps if t.gpu_gaps else float("nan")}


def record_runner_rows(runner, args, max_num_batched_tokens: int) -> dict:
    """The runner's part of the rows of record, on EVERY rank (before the workers enter their loop): each timed step
    is collective at TP > 1, so every rank queues the same plans (built from seeded generators, the same everywhere).
    Rank 0 prints the rows as they come."""
    if runner.device.type != "cuda":
        raise SystemExit("the record mode times CUDA kernels: run it on a GPU")
    rate = step_timing.copy_rate(runner.device)
    say = parallel.is_driver()
    if say:
        print(f"record on {torch.cuda.get_device_name()}, tp={parallel.tp_size()}, kernels={runner.kernels}, "
              f"copy {rate / 1e12:.2f} TB/s (read + write)")
        print(f"{'batch':>5} {'step ms':>8} {'floor ms':>9} {'x floor':>8}")
    decode = []
    # one row untimed first: the first timed row of a run came out slower than the same row timed again (2x H200,
    # TP=2, batch 1: 3.23 ms first, 2.80 ms twice after it; 2026-11-26)
    step_timing.decode_row(runner, _ints(args.batch_sizes)[0], args.context, rate)
    for b in _ints(args.batch_sizes):
        row = step_timing.decode_row(runner, b, args.context, rate)
        decode.append(row)
        if say:
            print(f"{b:5d} {row['step_ms']:8.2f} {row['floor_ms']:9.2f} {row['step_ms'] / row['floor_ms']:8.2f}",
                  flush=True)
    if say:
        print(f"{'seqs':>5} {'len':>5} {'ms':>9} {'tok/s':>10}")
    prefill = []
    for n in _ints(args.prefill_seqs):
        row = step_timing.prefill_row(runner, n, args.input_len, max_num_batched_tokens)
        prefill.append(row)
        if say:
            print(f"{n:5d} {args.input_len:5d} {row['ms']:9.1f} {row['tok_s']:10.0f}", flush=True)
    return {"copy_rate_tb_s": round(rate / 1e12, 3), "decode": decode, "prefill": prefill}


def record_kernel_counts(runner, args, decode: list[dict] | None) -> None:
    """The kernels per eager decode step of each decode row, on EVERY rank (collective at TP > 1), after everything
    else the run times: torch.profiler leaves the process's CUDA calls slower (step_timing.decode_kernels). Rank 0
    adds them to its rows (`decode`; None on the other ranks) and prints them."""
    counts = [step_timing.decode_kernels(runner, b, args.context) for b in _ints(args.batch_sizes)]
    if decode is not None:
        print(f"{'batch':>5} {'kernels':>8}  (one eager decode step, torch.profiler)")
        for row, n in zip(decode, counts):
            row["kernels_per_step"] = n
            print(f"{row['batch']:5d} {n:8d}")


def record(engine: LLMEngine, args, results: dict, runner_rows: dict, rng: random.Random) -> None:
    """The rows of record (issue #8/#9 schema): the runner's rows, and per decode row the host time per engine step
    outside the forward (cpu_ms) and queueing it (forward_queue_ms: the step's metadata, the graph replay or
    eager launches, sampling, the feed), from real engine steps (short prompts: the context is irrelevant to them)."""
    results.update(runner_rows)
    print(f"{'batch':>5} {'cpu ms':>7} {'queue ms':>9} {'idle ms':>8}  (engine steps)")
    for row in results["decode"]:
        prof = profile_steps(engine, row["batch"], 16, args.profile_steps, rng)
        row["cpu_ms"], row["gpu_idle_ms"] = round(prof["cpu_ms"], 4), round(prof["gpu_idle_ms"], 4)
        row["forward_queue_ms"] = round(prof["forward_queue_ms"], 4)
        row["overlap"] = prof["overlap"]
        print(f"{row['batch']:5d} {row['cpu_ms']:7.3f} {row['forward_queue_ms']:9.3f} {row['gpu_idle_ms']:8.3f}",
              flush=True)


def chat_prompts(engine: LLMEngine, n: int, input_len: int, rng: random.Random) -> list[list[int]]:
    """n new chat prompts of random text of about input_len tokens (the users' harness's kind), as token ids."""
    from qwen35.workload import random_prompt
    counter = SimpleNamespace(tok=engine.tokenizer)
    return [engine.tokenizer.encode_chat([{"role": "user", "content": random_prompt(counter, input_len, rng)}])
            for _ in range(n)]


def trace(engine: LLMEngine, args, rng: random.Random) -> dict:
    from qwen35.workload import NUM_WARMUP, output_lengths
    if engine.tokenizer.num_real_tokens > engine.config.vocab_size:
        raise SystemExit(f"trace: the prompts are text of this tokenizer ({engine.tokenizer.num_real_tokens} "
                         f"tokens), past the model's vocabulary ({engine.config.vocab_size}); use latency/static")

    def new_prompts(n: int) -> list[list[int]]:
        return chat_prompts(engine, n, args.input_len, rng)

    n_prompts = min(62, args.num_requests)
    prompts = new_prompts(n_prompts)
    lengths = output_lengths(args.output_len_dist, args.num_requests, args.output_len, rng)
    levels, cold_levels, cold_at = [], [], set(_ints(args.cold_levels))
    for c in _ints(args.levels):
        warm = [(prompts[i % n_prompts], args.output_len) for i in range(NUM_WARMUP)]
        timed = [(prompts[i % n_prompts], lengths[i]) for i in range(args.num_requests)]
        closed_loop(engine, warm, c, f"warm{c}")
        levels.append(_level(engine, timed, c, f"c{c}"))
        if c in cold_at:  # the same level on prompts never seen: nothing for the cache to serve
            new = new_prompts(args.num_requests)
            cold = _level(engine, list(zip(new, lengths)), c, f"cold{c}", cold=True)
            cold["cold_over_warm"] = cold["wall_s"] / levels[-1]["wall_s"]
            cold_levels.append(cold)
    score = sum(WEIGHTS.get(lv["concurrency"], 0) * lv["tok_s"] for lv in levels)
    return {"levels": levels, "cold_levels": cold_levels, "weighted_score": score, "output_lengths": lengths}


def _level(engine: LLMEngine, work: list[tuple[list[int], int]], c: int, tag: str, cold: bool = False) -> dict:
    """One timed closed-loop level, with the prompt tokens the prefix cache served in it."""
    hits0 = engine.stats()["prefix_cache_hit_tokens"]
    wall, tokens = closed_loop(engine, work, c, tag)
    hit_tokens = engine.stats()["prefix_cache_hit_tokens"] - hits0
    row = {"concurrency": c, "cold": cold, "requests": len(work), "wall_s": wall, "tokens": tokens,
           "tok_s": tokens / wall, "prompt_tokens": sum(len(ids) for ids, _ in work), "cache_hit_tokens": hit_tokens}
    print(f"  c={c:<3d}{' cold' if cold else ''} {tokens / wall:10.1f} tok/s  ({wall:.1f} s, "
          f"{hit_tokens} of {row['prompt_tokens']} prompt tokens from the cache)", flush=True)
    return row


def closed_loop(engine: LLMEngine, work: list[tuple[list[int], int]], concurrency: int, tag: str):
    """Keep exactly `concurrency` requests in the engine until `work` is done; (wall s, prompt+completion tokens)."""
    queue, tokens, live, k = list(work), 0, set(), 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            ids, n = queue.pop(0)
            rid = f"{tag}-{k}"
            k += 1
            params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=k)
            try:  # checked here, at the boundary: the engine trusts what it is given (one too large never runs)
                engine.check_request(ids, params)
            except ValueError as e:
                raise SystemExit(f"{tag}: {e} (lower --input-len/--output-len or raise --max-model-len)") from None
            engine.add_request(rid, ids, params)
            live.add(rid)
            tokens += len(ids)
        for o in engine.step():
            if o.finished:
                live.discard(o.request_id)
                tokens += o.num_completion_tokens
    return time.perf_counter() - t0, tokens


def _pairs(spec: str, sep: str) -> list[tuple[int, int]]:
    out = [tuple(int(x) for x in item.split(sep)) for item in spec.split(",") if item]
    if not out or any(len(p) != 2 for p in out):
        raise SystemExit(f"expected A{sep}B[,A{sep}B...], got {spec!r}")
    return out


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mode", default="record,trace",
                    help="comma list of: record (decode + prefill rows of record), static, trace, latency; or of "
                         "the create_engine traces prefill, decode, mixed (in a run of their own)")
    ap.add_argument("--context", type=int, default=1024, help="context of every sequence in the decode rows")
    ap.add_argument("--prefill-seqs", default="1,8,64", help="prompts per prefill row (of --input-len tokens)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--profile-steps", type=int, default=100,
                    help="decode steps timed per profiled batch size (cpu_ms: a request's one-off costs, joining the "
                         "decode batch, spread over this many steps as over a completion of that length)")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--cold-levels", default="64",
                    help="trace: concurrency levels also run on prompts never seen (comma list; empty: none)")
    ap.add_argument("--output-len-dist", default=workload.STANDARD_OUTPUT_LEN_DIST,
                    help=f"trace output lengths: {workload.FORMS} (default {workload.STANDARD_OUTPUT_LEN_DIST}, the "
                         "standard for synthetic weights)")
    g = ap.add_argument_group("latency")
    g.add_argument("--latency-shapes", default=latency.DEFAULT_SHAPES, help="PROMPT:OUTPUT tokens, comma separated")
    g.add_argument("--latency-reps", type=int, default=3, help="runs per shape (the median is reported)")
    g.add_argument("--compare-hf", action="store_true",
                   help="also time transformers' generate on the same weights in the same run (TP=1)")
    g.add_argument("--hf-reps", type=int, default=1, help="transformers runs per shape (the median is reported)")
    g = ap.add_argument_group("create_engine traces (prefill, decode, mixed)")
    g.add_argument("--harness-prefill", default="1x2048,1x8192,8x2048,4x8192",
                   help="BATCHxLEN prompts per prefill call, comma separated")
    g.add_argument("--harness-decode-batches", default="1,8,32,64")
    g.add_argument("--harness-context", type=int, default=1024, help="tokens per request before the decode calls")
    g.add_argument("--harness-steps", type=int, default=64, help="decode calls timed per batch")
    g.add_argument("--mixed-requests", type=int, default=128)
    g.add_argument("--mixed-concurrency", type=int, default=32)
    g.add_argument("--mixed-prompt-lens", default="128-2048", help="uniform range LO-HI")
    g.add_argument("--mixed-output-lens", default="16-256", help="uniform range LO-HI")
    g.add_argument("--mixed-prefill-batch", type=int, default=4, help="most new requests per prefill call")
    ap.add_argument("--out", default=None,
                    help="results JSON (default with record, latency or the create_engine traces: "
                         "benchmarks/results/<date>_<bench|latency|harness>_<device>_tp<N>.json)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(ap)
    ap.set_defaults(model="qwen3.5-35b-a3b", load_format="dummy", max_num_seqs=64)
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
    parallel.init_distributed(eargs.device_type)
    if modes & set(HARNESS_MODES):
        return run_harness(args, eargs, modes, argv)
    if "latency" in modes:
        shapes = latency.parse_shapes(args.latency_shapes)
        if eargs.num_kv_blocks is None and modes == {"latency"}:
            # one request at a time: KV for the longest shape only, which leaves room for transformers' copy
            eargs.max_model_len = eargs.max_model_len or max(p + o for p, o in shapes)
            eargs.num_kv_blocks = 2 * -(-eargs.max_model_len // eargs.block_size)
    engine = LLMEngine(eargs)
    # the runner's rows first, on every rank, while no request holds cache blocks or state slots
    runner_rows = record_runner_rows(engine.runner, args, engine.args.max_num_batched_tokens) if "record" in modes else None
    if not parallel.is_driver():
        engine.run_worker_loop()
        if "record" in modes:
            record_kernel_counts(engine.runner, args, None)
        parallel.destroy()
        return
    rng = random.Random(0)
    dev = torch.cuda.get_device_name() if engine.runner.device.type == "cuda" else "cpu"
    results = _header(args, eargs, dev, engine.runner, argv)
    out = args.out
    if out is None and modes & {"record", "latency"}:
        out = _default_out("bench" if "record" in modes else "latency", dev)
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
            sizes = _ints(args.batch_sizes)
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
        if "trace" in modes:
            print(f"trace: {args.num_requests} requests per level, prompts of {args.input_len} tokens, outputs "
                  f"{args.output_len_dist}")
            results["trace"] = trace(engine, args, rng)
            print(f"weighted score {results['trace']['weighted_score']:.0f}")
    finally:
        engine.shutdown()  # (the other ranks leave their loop)
    if "record" in modes:
        record_kernel_counts(engine.runner, args, results["decode"])
    _write(out, results)
    parallel.destroy()


def run_harness(args, eargs: EngineArgs, modes: set, argv) -> None:
    """The create_engine traces: every rank builds the LogitsEngine and makes the same calls; rank 0 reports."""
    from qwen35.api import create_engine
    from qwen35.hub import resolve_model
    model_dir = parallel.broadcast_object(resolve_model(eargs.model, load_format=eargs.load_format)
                                          if parallel.is_driver() else None)
    with open(f"{model_dir}/config.json") as f:
        raw = json.load(f)
    prefill = _pairs(args.harness_prefill, "x")
    batches = _ints(args.harness_decode_batches)
    prompt_lens, output_lens = _pairs(args.mixed_prompt_lens, "-")[0], _pairs(args.mixed_output_lens, "-")[0]
    seqs = max([b for b, _ in prefill] + batches + [args.mixed_concurrency])
    longest = max([n for _, n in prefill] + [args.harness_context + args.harness_steps + 2,
                                             prompt_lens[1] + output_lens[1]])
    eng = create_engine(raw, None if eargs.load_format == "dummy" else model_dir, device=eargs.device_type,
                        dtype=eargs.dtype, max_num_seqs=seqs, max_model_len=eargs.max_model_len or longest,
                        load_format=eargs.load_format, block_size=eargs.block_size,
                        gpu_memory_utilization=eargs.gpu_memory_utilization, num_kv_blocks=eargs.num_kv_blocks,
                        enforce_eager=eargs.enforce_eager, seed=eargs.seed, kernels=eargs.kernels)
    vocab = eng.runner.config.vocab_size
    rng = random.Random(0)  # the same on every rank: the same calls everywhere
    dev = torch.cuda.get_device_name() if eng.runner.device.type == "cuda" else "cpu"
    driver = parallel.is_driver()
    results = _header(args, eargs, dev, eng.runner, argv)
    if driver:
        print(f"create_engine traces on {dev}, tp={parallel.tp_size()}, kernels={eng.runner.kernels}, "
              f"dtype={eng.runner.dtype}, model {eargs.model}")
    if "prefill" in modes:
        results["prefill"] = rows = harness.prefill_rows(eng, prefill, vocab, 3, rng)
        if driver:
            for r in rows:
                print(f"  prefill {r['batch']:3d} x {r['len']:5d}: {r['ms']:9.1f} ms  {r['tok_s']:10.0f} tok/s",
                      flush=True)
    if "decode" in modes:
        results["decode"] = rows = harness.decode_rows(eng, batches, args.harness_context, args.harness_steps,
                                                       vocab, rng)
        if driver:
            for r in rows:
                print(f"  decode batch {r['batch']:3d} at {r['context']}: {r['ms_per_call']:8.2f} ms/call  "
                      f"{r['tok_s']:9.0f} tok/s", flush=True)
    if "mixed" in modes:
        results["mixed"] = r = harness.mixed_trace(eng, args.mixed_requests, args.mixed_concurrency, prompt_lens,
                                                   output_lens, args.mixed_prefill_batch, vocab, rng)
        if driver:
            print(f"  mixed: {r['requests']} requests, {r['concurrency']} live, {r['calls']} calls in "
                  f"{r['wall_s']:.1f} s: {r['tok_s_with_prefill']:.0f} tok/s with prompt tokens, "
                  f"{r['tok_s_without_prefill']:.0f} without", flush=True)
    if driver:
        _write(args.out or _default_out("harness", dev), results)
    parallel.destroy()


def _header(args, eargs: EngineArgs, dev: str, runner, argv) -> dict:
    return {"date": datetime.date.today().isoformat(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": dev, "tp": parallel.tp_size(), "model": eargs.model, "load_format": eargs.load_format,
            "dtype": str(runner.dtype), "kernels": runner.kernels,
            "command": f"torchrun --nproc-per-node {parallel.tp_size()} -m qwen35.bench "
                       + " ".join(sys.argv[1:] if argv is None else argv)}


def _default_out(kind: str, dev: str) -> str:
    slug = dev.replace("NVIDIA ", "").replace(" ", "").lower()
    return f"benchmarks/results/{datetime.date.today().isoformat()}_{kind}_{slug}_tp{parallel.tp_size()}.json"


def _write(out: str | None, results: dict) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
