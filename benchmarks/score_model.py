"""What a decode record says the users' HTTP score would be: a closed-loop replay of the throughput workload (the
serving contract's section 3) on measured step times.

    python -m benchmarks.score_model --record R.json [--throughput T.json] [--sensitivity]

Each level c runs the level's 64 requests with exactly c in flight: every step advances each running request by one
token at the record's step time for that batch size (linear between the recorded sizes), and a request that ends
lets the next one in. The output lengths are the throughput run's (`meta.settings.output_lengths` of --throughput),
else drawn from the standard exp:290,1024 with --seed. What a step-time replay leaves out (prefill, HTTP, admission)
is a per-level time: taken from --throughput's measured walls (its wall minus the replay of its own record, given by
--fit-record, default --record) or --overhead-s for every level. With --sensitivity, the score's change when the
step at one recorded batch size is 0.2 ms shorter. With --replicas R, R data-parallel engines of the record's share
each level (the contract allows any parallelism): on the 4x H200 records of 2026-11-28, two TP=2 engines model
300K and four TP=1 277K against one TP=4's 319K (two GPUs: two TP=1 204K, one TP=2 230K), since a level's wall is
its longest requests' tail at small batch, where one wider engine steps faster. A model, not a measurement: say so
wherever its figures go.
"""
from __future__ import annotations

import argparse
import json
import random

from qwen35.bench.workload import STANDARD_OUTPUT_LEN_DIST, output_lengths

LEVELS = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 8}  # concurrency -> weight (the contract's)
PROMPT_TOKENS = 64309  # per level: 64 prompts as the client counts them (1024-token texts with the chat template)


def step_ms(curve: list[tuple[int, float]], b: int) -> float:
    """The step time at batch b, linear between the recorded sizes (flat beyond them)."""
    if b <= curve[0][0]:
        return curve[0][1]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    return curve[-1][1]


def replay_s(curve: list[tuple[int, float]], lengths: list[int], c: int, replicas: int = 1) -> float:
    """Seconds of decode steps for one closed-loop level at concurrency c, on `replicas` engines of the record's
    (data parallel: each steps its own requests at its own batch's step time; a request is admitted, when one ends,
    to the engine with the fewest running, the earliest in time among equals)."""
    queue = list(lengths)
    running = [[] for _ in range(replicas)]
    clock = [0.0] * replicas

    def admit():
        while queue and sum(map(len, running)) < c:
            running[min(range(replicas), key=lambda j: (len(running[j]), clock[j]))].append(queue.pop(0))

    admit()
    end = 0.0
    while any(running):
        i = min((j for j in range(replicas) if running[j]), key=lambda j: clock[j])  # the next step to end
        clock[i] += step_ms(curve, len(running[i]))
        running[i] = [r - 1 for r in running[i] if r > 1]
        end = max(end, clock[i])
        for j in range(replicas):  # an idle engine starts its next request no earlier than now
            if not running[j]:
                clock[j] = max(clock[j], clock[i])
        admit()
    return end / 1e3


def curve_of(record: dict) -> list[tuple[int, float]]:
    return sorted((row["batch"], row["step_ms"]) for row in record["decode"])


def score(curve, lengths, overhead: dict[int, float], prompt_tokens: int = PROMPT_TOKENS,
          replicas: int = 1) -> tuple[float, dict]:
    """(weighted score, {c: (wall s, tok/s)})."""
    tokens = prompt_tokens + sum(lengths)
    levels = {}
    for c in LEVELS:
        wall = replay_s(curve, lengths, c, replicas) + overhead.get(c, 0.0)
        levels[c] = (wall, tokens / wall)
    return sum(w * levels[c][1] for c, w in LEVELS.items()), levels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", required=True, help="a qwen35.bench --mode record JSON (decode rows)")
    ap.add_argument("--throughput", help="a benchmarks.throughput JSON: its lengths and, with --fit-record, overheads")
    ap.add_argument("--fit-record", help="the record of the code the throughput run measured (default --record)")
    ap.add_argument("--overhead-s", type=float, default=0.0, help="per-level time besides the steps, without "
                    "--throughput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--replicas", type=int, default=1,
                    help="data-parallel engines of the record's, sharing each level's requests; the overhead "
                    "fitted from --throughput (that engine alone) over min(c, R)")
    args = ap.parse_args()
    with open(args.record) as f:
        curve = curve_of(json.load(f))
    overhead = {c: args.overhead_s for c in LEVELS}
    prompt_tokens = PROMPT_TOKENS
    if args.throughput:
        with open(args.throughput) as f:
            run = json.load(f)
        lengths = run["meta"]["settings"]["output_lengths"]
        fit = curve
        if args.fit_record:
            with open(args.fit_record) as f:
                fit = curve_of(json.load(f))
        measured = {lv["concurrency"]: lv for lv in run["levels"]}
        overhead = {c: measured[c]["wall_s"] - replay_s(fit, lengths, c) for c in LEVELS if c in measured}
        prompt_tokens = run["levels"][0]["prompt_tokens"]
    else:
        lengths = output_lengths(STANDARD_OUTPUT_LEN_DIST, 64, 1024, random.Random(args.seed))
    R = args.replicas
    if R > 1:  # the level's prefill and HTTP time shared by the min(c, R) engines that run its requests
        overhead = {c: overhead.get(c, 0.0) / min(c, R) for c in LEVELS}
    total, levels = score(curve, lengths, overhead, prompt_tokens, R)
    print(f"replay of {args.record}: steps at batch {', '.join(f'{b} {t:.3f} ms' for b, t in curve)}")
    print(f"{'c':>3} {'wall s':>8} {'overhead s':>11} {'tok/s':>9}")
    for c, (wall, tps) in levels.items():
        print(f"{c:3d} {wall:8.2f} {overhead.get(c, 0.0):11.2f} {tps:9.0f}")
    print(f"modelled weighted score {total:,.0f}")
    if args.sensitivity:
        for i, (b, t) in enumerate(curve):
            faster = list(curve)
            faster[i] = (b, t - 0.2)
            print(f"  batch {b:3d} 0.2 ms faster: "
                  f"{score(faster, lengths, overhead, prompt_tokens, R)[0] - total:+,.0f}")


if __name__ == "__main__":
    main()
