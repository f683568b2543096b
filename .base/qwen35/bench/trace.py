"""The closed-loop workload of the serving contract through LLMEngine (`qwen35.bench --mode trace`): per level, 2
warm-up then the timed requests, exactly c in flight; chat prompts of random text, the same at every level; after
the warm level of each concurrency of --cold-levels, the same level on prompts never seen. Weighted score as the
contract's."""
from __future__ import annotations

import random
import time
from types import SimpleNamespace

from qwen35.bench.args import ints
from qwen35.bench.workload import NUM_WARMUP, output_lengths, random_prompt
from qwen35.engine import LLMEngine
from scheduler.sampling_params import SamplingParams

WEIGHTS = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}


def chat_prompts(engine: LLMEngine, n: int, input_len: int, rng: random.Random) -> list[list[int]]:
    """n new chat prompts of random text of about input_len tokens (the users' harness's kind), as token ids."""
    counter = SimpleNamespace(tok=engine.tokenizer)
    return [engine.tokenizer.encode_chat([{"role": "user", "content": random_prompt(counter, input_len, rng)}])
            for _ in range(n)]


def trace(engine: LLMEngine, args, rng: random.Random) -> dict:
    if engine.tokenizer.num_real_tokens > engine.config.vocab_size:
        raise SystemExit(f"trace: the prompts are text of this tokenizer ({engine.tokenizer.num_real_tokens} "
                         f"tokens), past the model's vocabulary ({engine.config.vocab_size}); use latency/static")

    def new_prompts(n: int) -> list[list[int]]:
        return chat_prompts(engine, n, args.input_len, rng)

    n_prompts = min(62, args.num_requests)
    prompts = new_prompts(n_prompts)
    lengths = output_lengths(args.output_len_dist, args.num_requests, args.output_len, rng)
    levels, cold_levels, cold_at = [], [], set(ints(args.cold_levels))
    for c in ints(args.levels):
        warm = [(prompts[i % n_prompts], args.output_len) for i in range(NUM_WARMUP)]
        timed = [(prompts[i % n_prompts], lengths[i]) for i in range(args.num_requests)]
        closed_loop(engine, warm, c, f"warm{c}")
        levels.append(level(engine, timed, c, f"c{c}"))
        if c in cold_at:  # the same level on prompts never seen: nothing for the cache to serve
            new = new_prompts(args.num_requests)
            cold = level(engine, list(zip(new, lengths)), c, f"cold{c}", cold=True)
            cold["cold_over_warm"] = cold["wall_s"] / levels[-1]["wall_s"]
            cold_levels.append(cold)
    score = sum(WEIGHTS.get(lv["concurrency"], 0) * lv["tok_s"] for lv in levels)
    return {"levels": levels, "cold_levels": cold_levels, "weighted_score": score, "output_lengths": lengths}


def level(engine: LLMEngine, work: list[tuple[list[int], int]], c: int, tag: str, cold: bool = False) -> dict:
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
