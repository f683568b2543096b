"""Where a cold trace level's time goes: the engine's step wall times by kind of step, and Triton compiles per level.

    python -m benchmarks.cold_levels [--input-len 1024] [--div 1] [engine flags, e.g. --no-warm-up]

Three closed-loop levels at concurrency 64 on the full-size dummy model (as `qwen35.bench --mode trace` runs them,
standard exp:290,1024 output lengths; --div N divides them, for a quick run on a small model): cold1 and cold2 on
prompts never seen, then warm on cold2's prompts (the prefix cache serves them). Per level: wall time, steps, the
plans that were not pure decode (mixed: prefill chunks beside decode rows), the Triton kernels compiled during the
level (the engine counts and logs every compile after its start), the slowest steps with the plan queued in them
and before them ((rows, tokens): with overlap a step waits on the plan before its own), and the mean of the
pure-decode steps. A level
that compiles pays ~1 s per kernel in the middle of serving: the start-up warm-up (ModelRunner.warm_up) is there
to leave none.
"""
from __future__ import annotations

import argparse
import random
import time

from qwen35.bench.trace import chat_prompts, closed_loop
from qwen35.engine import EngineArgs, LLMEngine
from qwen35.bench.workload import STANDARD_OUTPUT_LEN_DIST, output_lengths

CONCURRENCY = 64


def level(engine: LLMEngine, name: str, work: list[tuple[list[int], int]], plans: list, times: list) -> dict:
    """One closed-loop level (bench.closed_loop, as the trace runs it) with its steps' plans and wall times."""
    plans.clear()
    times.clear()
    c0 = engine.late_compiles
    wall, _ = closed_loop(engine, work, CONCURRENCY, name)
    mixed = {i for i, (rows, tokens) in enumerate(plans) if tokens != rows}
    slow = sorted(range(len(times)), key=lambda i: -times[i])[:10]
    decode = [t for i, t in enumerate(times) if i and i not in mixed and i - 1 not in mixed]
    row = {"level": name, "wall_s": round(wall, 2), "steps": len(times), "mixed_plans": len(mixed),
           "compiles": engine.late_compiles - c0, "decode_step_ms": round(1e3 * sum(decode) / max(1, len(decode)), 2),
           "slowest": [(i, round(1e3 * times[i], 1), plans[i] if i < len(plans) else None,
                        plans[i - 1] if 0 < i <= len(plans) else None) for i in slow]}
    print(f"{name}: wall {row['wall_s']} s, {row['steps']} steps, {row['mixed_plans']} mixed plans, "
          f"{row['compiles']} Triton compiles, pure-decode steps {row['decode_step_ms']} ms mean", flush=True)
    print("  slowest (step, ms, its plan (rows, tokens), the plan before):", row["slowest"], flush=True)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(ap)
    ap.set_defaults(model="qwen3.5-35b-a3b", load_format="dummy", max_num_seqs=CONCURRENCY)
    for a in ap._actions:
        if a.dest == "model":
            a.required = False
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--div", type=int, default=1, help="divide the output lengths by this")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineArgs.from_cli(args))
    rng = random.Random(0)
    lengths = [max(1, n // args.div) for n in output_lengths(STANDARD_OUTPUT_LEN_DIST, CONCURRENCY, 256, rng)]
    plans: list[tuple[int, int]] = []  # (rows, tokens) of each plan scheduled
    times: list[float] = []            # wall time of each engine step
    schedule, step = engine.scheduler.schedule, engine.step

    def logged_schedule():
        scheduled = schedule()
        plans.append((scheduled.plan.num_seqs, scheduled.plan.num_tokens))
        return scheduled

    def timed_step():
        t0 = time.perf_counter()
        outputs = step()
        times.append(time.perf_counter() - t0)
        return outputs
    engine.scheduler.schedule, engine.step = logged_schedule, timed_step
    # first-use costs of the decode path out of the levels
    closed_loop(engine, [(ids, 16) for ids in chat_prompts(engine, 4, args.input_len, rng)], CONCURRENCY, "warm-up")
    a, b = (chat_prompts(engine, CONCURRENCY, args.input_len, rng) for _ in range(2))
    try:
        for name, ps in (("cold1", a), ("cold2", b), ("warm", b)):
            level(engine, name, list(zip(ps, lengths)), plans, times)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
