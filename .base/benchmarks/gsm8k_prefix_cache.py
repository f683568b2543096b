"""How much of the GSM8K 8-shot prompts the prefix cache serves (issue #9 target: >= 75% of the prompt tokens after
the first prompt), in-engine, on the CPU with the tiny model by default: the cache hits on tokens, so random weights
measure it as well as real ones.

    python -m benchmarks.gsm8k_prefix_cache [--model tiny] [--limit 200] [--concurrency 8] [--max-tokens 16]
        [--prefix-cache-interval 256 ...]  [--out result.json]

The prompts are those of benchmarks/gsm8k.py (the 8 exemplars as a multi-turn chat, then the question), rendered by
the model's chat template with thinking off, as the server renders them. The first prompt runs alone; the rest run
in a closed loop of --concurrency requests (the correctness run's 8 by default), greedy, with the contract's stop
strings and --max-tokens (the contract's 256 only makes the run longer: the replies are not resent).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from benchmarks.gsm8k import DEFAULT_DATA, load_jsonl, messages_for
from qwen35.engine import EngineArgs, LLMEngine
from scheduler.sampling_params import SamplingParams

STOP = ["Q:", "</s>", "<|im_end|>"]


def gsm8k_prompts(tokenizer, data: str = DEFAULT_DATA, limit: int = 200) -> list[list[int]]:
    shots = load_jsonl(os.path.join(data, "cot_8shot.jsonl"))
    problems = load_jsonl(os.path.join(data, "test.jsonl"))[:limit]
    return [tokenizer.encode_chat(messages_for(shots, p["question"]), enable_thinking=False) for p in problems]


def hit_rate(engine: LLMEngine, prompts: list[list[int]], concurrency: int = 8, max_tokens: int = 16) -> dict:
    """Run the prompts (the first alone, then `concurrency` at a time); the cache's counters over the others."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP)
    _run(engine, prompts[:1], 1, params, "first")
    before = engine.stats()
    _run(engine, prompts[1:], concurrency, params, "rest")
    after = engine.stats()
    tokens = sum(len(p) for p in prompts[1:])
    hit_tokens = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {"prompts": len(prompts), "concurrency": concurrency, "prompt_tokens": [len(p) for p in prompts],
            "hits_after_first": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            "prompt_tokens_after_first": tokens, "hit_tokens_after_first": hit_tokens,
            "hit_rate": hit_tokens / tokens if tokens else 0.0}


def _run(engine: LLMEngine, prompts: list[list[int]], concurrency: int, params: SamplingParams, tag: str) -> None:
    queue, live = list(enumerate(prompts)), set()
    while queue or live:
        while queue and len(live) < concurrency:
            i, ids = queue.pop(0)
            engine.add_request(f"{tag}-{i}", ids, params)
            live.add(f"{tag}-{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(ap)
    ap.set_defaults(model="tiny", device="cpu", max_num_seqs=8, max_model_len=2048)
    for a in ap._actions:  # --model has a default here
        if a.dest == "model":
            a.required = False
    ap.add_argument("--data", default=DEFAULT_DATA, help="directory with test.jsonl and cot_8shot.jsonl")
    ap.add_argument("--limit", type=int, default=200, help="first N test problems")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight after the first")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineArgs.from_cli(args))
    result = hit_rate(engine, gsm8k_prompts(engine.tokenizer, args.data, args.limit), args.concurrency,
                      args.max_tokens)
    print(f"GSM8K 8-shot, {result['prompts']} prompts ({min(result['prompt_tokens'])}-"
          f"{max(result['prompt_tokens'])} tokens), concurrency {args.concurrency}: after the first, "
          f"{result['hit_tokens_after_first']} of {result['prompt_tokens_after_first']} prompt tokens from the cache "
          f"({result['hit_rate']:.1%}), {result['hits_after_first']} hits")
    if args.out:
        result = {"date": datetime.date.today().isoformat(), "device": str(engine.device), "model": args.model,
                  "command": "python -m benchmarks.gsm8k_prefix_cache " + " ".join(argv if argv is not None
                                                                                     else sys.argv[1:]), **result}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
