"""The traces correctness harnesses drive through `create_engine` (qwen35/api.py), timed: `qwen35.bench --mode
prefill,decode,mixed`.

    prefill  batched long-prompt prefill: B prompts of L tokens in one `prefill` call (rows "BxL"), tokens/s
    decode   B live requests at context C, then repeated `decode` calls over all of them: tokens/s and ms per call
    mixed    a closed loop of prefill, decode and remove calls: up to `concurrency` live requests, new ones
             prefilled as others finish (in batches of at most `prefill_batch`), each finished one removed in random
             order; tokens/s with and without the prompt tokens (output tokens: each request's first, from its
             prefill call, and every decoded one). Then the same loop on new requests with unfinished ones removed
             and prefilled again later, out of order (mixed_requeue: --mixed-requeue per decode call)

Every call returns next-token logits [B, vocab] on every rank (as a harness compares them with its reference); the
token fed back is the logits' argmax. create_engine warms up to the largest prefill call made here, so the first
call of a shape is reported beside the steady ones. Prompts are random ids, the same on every rank (seeded), so
that under torchrun every rank makes the same calls. Timings are wall time around the calls, after a CUDA synchronize.
run() is the modes' driver (cli.py), on every rank.
"""
from __future__ import annotations

import json
import random
import statistics
import time

import torch

from dist import parallel
from qwen35.api import create_engine
from qwen35.bench.args import ints, pairs
from qwen35.bench.results import default_out, device_name, header, write
from qwen35.hub import resolve_model


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[torch.Tensor]:
    return [torch.tensor([rng.randrange(vocab) for _ in range(length)]) for _ in range(n)]


def prefill_rows(eng, shapes: list[tuple[int, int]], vocab: int, reps: int, rng: random.Random) -> list[dict]:
    """Per (B, L): B fresh prompts of L tokens in one prefill call; median wall of `reps` after the first call of
    the shape, which is reported beside it (first_ms: create_engine's warm-up should leave it no slower)."""
    dev, rows = eng.runner.device, []
    for b, length in shapes:
        walls = []
        for r in range(reps + 1):
            ids = [f"p{b}x{length}-{r}-{i}" for i in range(b)]
            prompts = _prompts(rng, vocab, b, length)
            _sync(dev)
            t0 = time.perf_counter()
            eng.prefill(ids, prompts)
            _sync(dev)
            walls.append(time.perf_counter() - t0)
            eng.remove(ids)
        wall = statistics.median(walls[1:])
        rows.append({"batch": b, "len": length, "ms": round(1e3 * wall, 2), "tok_s": round(b * length / wall, 1),
                     "first_ms": round(1e3 * walls[0], 2)})
    return rows


DECODE_PREFILL_TOKENS = 16384  # decode_rows prefills its requests about this many tokens a call


def decode_rows(eng, batches: list[int], context: int, steps: int, vocab: int, rng: random.Random) -> list[dict]:
    """Per B: B requests prefilled to `context` tokens (untimed, a few at a time), then decode calls over all B,
    each feeding the argmax of the previous call's logits (on the device: the host queues calls ahead). The first
    10 calls are timed one by one (a sync around each: first_call_ms, the shape's first call after create_engine,
    beside tenth_call_ms; *_host_ms: until decode returned, the host's share), then `steps` calls back to back
    (ms_per_call, tok_s)."""
    dev, rows = eng.runner.device, []
    for b in batches:
        ids = [f"d{b}-{i}" for i in range(b)]
        per_call = max(1, DECODE_PREFILL_TOKENS // context)
        last = []
        for s in range(0, b, per_call):
            last.append(eng.prefill(ids[s:s + per_call], _prompts(rng, vocab, len(ids[s:s + per_call]), context)))
        tokens = torch.cat(last).argmax(-1)
        single, queued = [], []
        for _ in range(10):
            _sync(dev)
            t0 = time.perf_counter()
            logits = eng.decode(ids, tokens)
            queued.append(time.perf_counter() - t0)
            tokens = logits.argmax(-1)
            _sync(dev)
            single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = eng.decode(ids, tokens).argmax(-1)
        _sync(dev)
        wall = time.perf_counter() - t0
        eng.remove(ids)
        rows.append({"batch": b, "context": context, "steps": steps, "ms_per_call": round(1e3 * wall / steps, 3),
                     "tok_s": round(b * steps / wall, 1), "first_call_ms": round(1e3 * single[0], 3),
                     "tenth_call_ms": round(1e3 * single[9], 3), "first_call_host_ms": round(1e3 * queued[0], 3),
                     "tenth_call_host_ms": round(1e3 * queued[9], 3)})
    return rows


def mixed_trace(eng, num_requests: int, concurrency: int, prompt_lens: tuple[int, int],
                output_lens: tuple[int, int], prefill_batch: int, vocab: int, rng: random.Random,
                requeue: float = 0.0) -> dict:
    """The closed loop of the module doc. Lengths uniform in the given [lo, hi] ranges. With `requeue` > 0, after
    each decode call a live request is, with that probability, removed before it finished and put back in the
    queue at a random place (so removals and re-prefills come in any order), to be prefilled again from its prompt
    and the tokens it has output (a preempting server's recompute) and then decoded on; those prefill calls' tokens
    count as prefill tokens (reprefilled_tokens says how many)."""
    work = [(_prompts(rng, vocab, 1, rng.randint(*prompt_lens))[0], rng.randint(*output_lens))
            for _ in range(num_requests)]
    pending = list(range(num_requests))
    live: dict[int, int] = {}  # request -> tokens still to decode
    out: dict[int, list[int]] = {}  # request -> its output tokens so far (the last one is fed next)
    prefill_tokens = output_tokens = calls = prefill_calls = requeued = reprefilled = 0
    prefill_s = decode_s = 0.0  # wall time of the prefill calls and of the decode calls, each up to its tokens read
    dev = eng.runner.device
    _sync(dev)
    t0 = time.perf_counter()
    while pending or live:
        room = min(concurrency - len(live), prefill_batch, len(pending))
        if room > 0:
            new = [pending.pop(0) for _ in range(room)]
            inputs = [torch.cat([work[r][0], torch.tensor(out[r])]) if r in out else work[r][0] for r in new]
            t1 = time.perf_counter()
            logits = eng.prefill(new, inputs)
            tokens = logits.argmax(-1).tolist()
            prefill_s += time.perf_counter() - t1
            for r, t in zip(new, tokens):
                out.setdefault(r, []).append(t)  # the prefill gave the next output token
                live[r] = work[r][1] - len(out[r])
            prefill_tokens += sum(map(len, inputs))
            reprefilled += sum(len(x) - len(work[r][0]) for r, x in zip(new, inputs))
            output_tokens += len(new)
            calls += 1
            prefill_calls += 1
        active = [r for r, left in live.items() if left > 0]
        if active:
            t1 = time.perf_counter()
            logits = eng.decode(active, torch.tensor([out[r][-1] for r in active]))
            tokens = logits.argmax(-1).tolist()
            decode_s += time.perf_counter() - t1
            for r, t in zip(active, tokens):
                live[r] -= 1
                out[r].append(t)
            output_tokens += len(active)
            calls += 1
        done = [r for r, left in live.items() if left == 0]
        rng.shuffle(done)  # removed in any order
        for r in done:
            eng.remove([r])
            del live[r]
        if requeue and live and rng.random() < requeue:
            r = rng.choice(list(live))
            eng.remove([r])
            del live[r]
            pending.insert(rng.randrange(len(pending) + 1), r)
            requeued += 1
    _sync(dev)
    wall = time.perf_counter() - t0
    return {"requests": num_requests, "concurrency": concurrency, "prompt_lens": list(prompt_lens),
            "output_lens": list(output_lens), "prefill_batch": prefill_batch, "calls": calls, "wall_s": round(wall, 3),
            "prefill_calls": prefill_calls, "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3),
            "prefill_tokens": prefill_tokens, "output_tokens": output_tokens, "requeue": requeue,
            "requeued": requeued, "reprefilled_tokens": reprefilled,
            "tok_s_with_prefill": round((prefill_tokens + output_tokens) / wall, 1),
            "tok_s_without_prefill": round(output_tokens / wall, 1)}


def run(args, eargs, modes: set, argv) -> None:
    """The create_engine traces: every rank builds the LogitsEngine and makes the same calls; rank 0 reports."""
    model_dir = parallel.broadcast_object(resolve_model(eargs.model, load_format=eargs.load_format)
                                          if parallel.is_driver() else None)
    with open(f"{model_dir}/config.json") as f:
        raw = json.load(f)
    prefill = pairs(args.harness_prefill, "x")
    batches = ints(args.harness_decode_batches)
    prompt_lens, output_lens = pairs(args.mixed_prompt_lens, "-")[0], pairs(args.mixed_output_lens, "-")[0]
    seqs = max([b for b, _ in prefill] + batches + [args.mixed_concurrency])
    longest = max([n for _, n in prefill] + [args.harness_context + 10 + args.harness_steps + 1,
                                             prompt_lens[1] + output_lens[1]])
    # the warm-up reaches the largest prefill call the traces make (create_engine: no measured call compiles)
    per_call = max(1, DECODE_PREFILL_TOKENS // args.harness_context)
    largest_call = max([b * n for b, n in prefill] + [min(b, per_call) * args.harness_context for b in batches]
                       + [args.mixed_prefill_batch * (prompt_lens[1] + output_lens[1])])
    eng = create_engine(raw, None if eargs.random_weights else model_dir,
                        device=eargs.device_type, dtype=eargs.dtype, max_num_seqs=seqs,
                        max_model_len=eargs.max_model_len or longest, load_format=eargs.load_format,
                        block_size=eargs.block_size, gpu_memory_utilization=eargs.gpu_memory_utilization,
                        num_kv_blocks=eargs.num_kv_blocks, enforce_eager=eargs.enforce_eager, seed=eargs.seed,
                        kernels=eargs.kernels, warm_up=eargs.warm_up,
                        max_num_batched_tokens=max(eargs.max_num_batched_tokens, largest_call))
    vocab = eng.runner.config.vocab_size
    rng = random.Random(0)  # the same on every rank: the same calls everywhere
    dev = device_name(eng.runner)
    driver = parallel.is_driver()
    results = header(eargs, dev, eng.runner, argv)
    results["create_engine_s"] = round(eng.creation_s, 2)
    if driver:
        print(f"create_engine traces on {dev}, tp={parallel.tp_size()}, kernels={eng.runner.kernels}, "
              f"dtype={eng.runner.dtype}, model {eargs.model}; create_engine took {eng.creation_s:.1f} s")
    if "prefill" in modes:
        results["prefill"] = rows = prefill_rows(eng, prefill, vocab, 3, rng)
        if driver:
            for r in rows:
                print(f"  prefill {r['batch']:3d} x {r['len']:5d}: {r['ms']:9.1f} ms  {r['tok_s']:10.0f} tok/s  "
                      f"(first call {r['first_ms']:.1f} ms)", flush=True)
    if "decode" in modes:
        results["decode"] = rows = decode_rows(eng, batches, args.harness_context, args.harness_steps,
                                                       vocab, rng)
        if driver:
            for r in rows:
                print(f"  decode batch {r['batch']:3d} at {r['context']}: {r['ms_per_call']:8.2f} ms/call  "
                      f"{r['tok_s']:9.0f} tok/s  (first call {r['first_call_ms']:.2f} ms, tenth "
                      f"{r['tenth_call_ms']:.2f} ms, each synced; host {r['first_call_host_ms']:.2f} / "
                      f"{r['tenth_call_host_ms']:.2f} ms)", flush=True)
    if "mixed" in modes:
        for key, requeue in (("mixed", 0.0), ("mixed_requeue", args.mixed_requeue)):
            results[key] = r = mixed_trace(eng, args.mixed_requests, args.mixed_concurrency, prompt_lens,
                                           output_lens, args.mixed_prefill_batch, vocab, rng, requeue)
            if driver:
                print(f"  {key}: {r['requests']} requests, {r['concurrency']} live, {r['calls']} calls in "
                      f"{r['wall_s']:.1f} s: {r['tok_s_with_prefill']:.0f} tok/s with prompt tokens, "
                      f"{r['tok_s_without_prefill']:.0f} without ({r['requeued']} removed and prefilled again, "
                      f"{r['reprefilled_tokens']} tokens recomputed); {r['prefill_calls']} prefill calls "
                      f"{r['prefill_s']:.2f} s, {r['calls'] - r['prefill_calls']} decode calls {r['decode_s']:.2f} s",
                      flush=True)
    if driver:
        write(args.out or default_out("harness", dev), results)
    parallel.destroy()
