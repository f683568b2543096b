"""Throughput benchmark: the serving contract's section 3 workload, against a running server.

    python -m benchmarks.throughput --url http://127.0.0.1:8000 [--levels 1,2,4,8,16,32,64] [--num-requests 64]
        [--prompt-len 1024] [--max-tokens 1024] [--ignore-eos]
        [--output-len-dist exp:MEAN,CAP|fixed:N|uniform:A-B|normal:MEAN,STD|none]
        [--device-info "8x H200, TP=8"] [--out benchmarks/results/throughput.json]

Per level: 2 warm-up requests, then `--num-requests` timed ones in a closed loop (exactly c in flight). All but 2 are
random-token prompts (a run of consecutive vocabulary ids from a random start, re-tokenized until it is exactly
`--prompt-len` tokens), the same prompts at every level; the other 2 are the arithmetic spot check at temperature 0,
which passes when "56" appears in the answer (with synthetic weights it fails: reported, not fatal).
tok/s = (prompt tokens of the rendered chat template + completion tokens re-tokenized from the content) / wall time;
the score weights the levels 1,2,4,8,16,32,64 by 1,1,2,2,4,4,8.
Synthetic weights never stop on their own: `--output-len-dist` fixes each request's length (max_tokens + ignore_eos);
the lengths drawn are the same at every level and are recorded in the results. The default is the standard
exp:290,1024 (see qwen35/bench/workload.py: the users' completions average ~290 tokens, and the longest request of a
level sets its wall time); fixed lengths make extra, labelled rows only. With real weights, `--output-len-dist none`
lets every completion end on its own, as the users' harness does.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import sys

from benchmarks.common import Counter, add_server_args, client, closed_loop, served_model, server_counters
from qwen35.bench import workload

WEIGHTS = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}
SPOT_QUESTION = "What is 7 * 8? Only output the number, nothing else."
SPOT_ANSWER = "56"
NUM_SPOT = 2
NUM_WARMUP = workload.NUM_WARMUP


def output_lengths(spec: str | None, n: int, default: int, rng: random.Random) -> list[int]:
    """qwen35.workload.output_lengths, with a bad spec a usage error."""
    try:
        return workload.output_lengths(spec, n, default, rng)
    except ValueError as e:
        raise SystemExit(f"--output-len-dist: {e}")


def build_payloads(args, model: str, counter: Counter) -> tuple[list[dict], list[int], list[bool]]:
    """The timed requests of one level (the same at every level): payloads, client-side prompt counts, spot flags."""
    rng = random.Random(args.seed)
    n_random = args.num_requests - NUM_SPOT
    texts = [workload.random_prompt(counter, args.prompt_len, rng) for _ in range(n_random)]
    # --max-tokens is the harness's cap on every request, drawn lengths included
    lengths = [min(n, args.max_tokens) for n in output_lengths(args.output_len_dist, args.num_requests,
                                                               args.max_tokens, rng)]
    # the spot checks go to fixed places among the random prompts
    spot_at = {args.num_requests // 4, (3 * args.num_requests) // 4}
    payloads, counts, is_spot = [], [], []
    for i in range(args.num_requests):
        spot = i in spot_at
        messages = [{"role": "user", "content": SPOT_QUESTION if spot else texts.pop()}]
        payload = {"model": model, "messages": messages, "max_tokens": lengths[i],
                   "temperature": 0 if spot else 1.0}
        if args.ignore_eos or args.output_len_dist:
            payload["ignore_eos"] = True
        payloads.append(payload)
        counts.append(counter.prompt(messages))
        is_spot.append(spot)
    return payloads, counts, is_spot


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


SERVER_COUNTERS = ("num_steps", "spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_graph_steps",
                   "spec_verify_eager_steps")


def _speculation(counted: dict) -> str:
    """What the server's speculation did over a level, for the level's line (nothing when it drafted nothing)."""
    drafted = counted.get("spec_drafted_tokens", 0)
    if not drafted:
        return ""
    return (f"  drafts {counted.get('spec_accepted_tokens', 0):.0f}/{drafted:.0f} accepted, verify steps "
            f"{counted.get('spec_verify_graph_steps', 0):.0f} graph + {counted.get('spec_verify_eager_steps', 0):.0f} "
            f"eager of {counted.get('num_steps', 0):.0f}")


async def run(args) -> dict:
    counter = Counter(args.tokenizer)
    levels = [int(c) for c in args.levels.split(",")]
    async with client(args, max(levels)) as http:
        model = await served_model(http, args.model)
        payloads, prompt_counts, is_spot = build_payloads(args, model, counter)
        warmup = [p for p, s in zip(payloads, is_spot) if not s][:NUM_WARMUP]
        templated = statistics.mean(n for n, s in zip(prompt_counts, is_spot) if not s)
        print(f"{len(payloads)} requests per level ({NUM_SPOT} spot checks), prompts of {args.prompt_len} tokens "
              f"({templated:.0f} with the chat template), levels {levels}", flush=True)
        rows = []
        for c in levels:
            await closed_loop(http, warmup, min(c, NUM_WARMUP))
            before = await server_counters(http)
            results, wall = await closed_loop(http, payloads, c)
            after = await server_counters(http)
            ok = [r for r in results if r.ok]
            prompt_tokens = sum(prompt_counts[r.index] for r in ok)
            completion_tokens = sum(counter.text(r.content) for r in ok)
            spots = [SPOT_ANSWER in r.content for r, s in zip(results, is_spot) if s]
            latencies = [r.latency_s for r in ok]
            row = {
                "concurrency": c, "wall_s": round(wall, 3), "requests": len(results), "errors": len(results) - len(ok),
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "tok_s": round((prompt_tokens + completion_tokens) / wall, 2),
                "completion_tok_s": round(completion_tokens / wall, 2),
                "server_usage": {k: sum(r.body["usage"][k] for r in ok)
                                 for k in ("prompt_tokens", "completion_tokens")},
                "finish_reasons": {f: sum(r.body["choices"][0]["finish_reason"] == f for r in ok)
                                   for f in ("stop", "length")},
                "latency_s": {"mean": round(statistics.mean(latencies), 3) if latencies else 0.0,
                              "p50": round(pct(latencies, 0.5), 3), "p90": round(pct(latencies, 0.9), 3),
                              "max": round(max(latencies, default=0.0), 3)},
                "spot_checks": {"passed": sum(spots), "total": len(spots)},
                "first_errors": [r.error for r in results if not r.ok][:3],
                # what the server counted over the level (its steps; speculation's drafts, acceptances, verify steps)
                "server_counters": {k: after[k] - before[k] for k in SERVER_COUNTERS if k in after and k in before},
            }
            rows.append(row)
            print(f"c={c:>3}: {row['tok_s']:>10.1f} tok/s  wall {wall:7.2f} s  tokens {prompt_tokens} prompt + "
                  f"{completion_tokens} completion  latency p50 {row['latency_s']['p50']:.2f} s  "
                  f"spot {sum(spots)}/{len(spots)}  errors {row['errors']}{_speculation(row['server_counters'])}",
                  flush=True)
    weighted = [r for r in rows if r["concurrency"] in WEIGHTS]
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "device_info": args.device_info, "notes": args.notes,
            "client_host": platform.node(), "url": args.url, "model": model,
            "settings": {"levels": levels, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens, "ignore_eos": bool(args.ignore_eos or args.output_len_dist),
                         "output_len_dist": args.output_len_dist, "seed": args.seed,
                         "output_lengths": [p["max_tokens"] for p in payloads]},
        },
        "levels": rows,
        "weighted_score": round(sum(WEIGHTS[r["concurrency"]] * r["tok_s"] for r in weighted), 1),
        "score_complete": sorted(r["concurrency"] for r in weighted) == sorted(WEIGHTS),
        "spot_checks": {"passed": sum(r["spot_checks"]["passed"] for r in rows),
                        "total": sum(r["spot_checks"]["total"] for r in rows)},
        "errors": sum(r["errors"] for r in rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="comma-separated concurrency levels, run in order")
    p.add_argument("--num-requests", type=int, default=64, help="timed requests per level (2 are spot checks)")
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens of each random prompt")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (each request runs to max_tokens)")
    p.add_argument("--output-len-dist", default=workload.STANDARD_OUTPUT_LEN_DIST,
                   help="per-request output lengths (implies ignore_eos): exp:MEAN,CAP (default "
                        f"{workload.STANDARD_OUTPUT_LEN_DIST}, the standard for synthetic weights), fixed:N, "
                        "uniform:A-B or normal:MEAN,STD; 'none': completions end on their own (real weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the output lengths")
    p.add_argument("--device-info", default="", help="what the server runs on, recorded in the results")
    p.add_argument("--notes", default="", help="free text recorded in the results")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    if args.output_len_dist in ("none", ""):
        args.output_len_dist = None
    if args.num_requests < NUM_SPOT + NUM_WARMUP:
        p.error(f"--num-requests must be at least {NUM_SPOT + NUM_WARMUP}")
    out = asyncio.run(run(args))
    print(f"weighted score {out['weighted_score']:.1f}{'' if out['score_complete'] else ' (partial: not all levels)'}"
          f"; spot checks {out['spot_checks']['passed']}/{out['spot_checks']['total']}; errors {out['errors']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results in {args.out}")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
