"""The rows of record (`qwen35.bench --mode record`; step_timing.py says how each is measured): per batch size, a
decode step (CUDA graph, CUDA events), its memory floor, the host time per engine step outside the forward, and
last, kernels per step; prefill rows."""
from __future__ import annotations

import random

import torch

from dist import parallel
from qwen35.bench import step_timing
from qwen35.bench.args import ints
from qwen35.bench.engine_runs import profile_steps
from qwen35.engine import LLMEngine


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
    step_timing.decode_row(runner, ints(args.batch_sizes)[0], args.context, rate)
    for b in ints(args.batch_sizes):
        row = step_timing.decode_row(runner, b, args.context, rate)
        decode.append(row)
        if say:
            print(f"{b:5d} {row['step_ms']:8.2f} {row['floor_ms']:9.2f} {row['step_ms'] / row['floor_ms']:8.2f}",
                  flush=True)
    if say:
        print(f"{'seqs':>5} {'len':>5} {'ms':>9} {'tok/s':>10}")
    prefill = []
    for n in ints(args.prefill_seqs):
        row = step_timing.prefill_row(runner, n, args.input_len, max_num_batched_tokens)
        prefill.append(row)
        if say:
            print(f"{n:5d} {args.input_len:5d} {row['ms']:9.1f} {row['tok_s']:10.0f}", flush=True)
    return {"copy_rate_tb_s": round(rate / 1e12, 3), "decode": decode, "prefill": prefill}


def record_kernel_counts(runner, args, decode: list[dict] | None) -> None:
    """The kernels per eager decode step of each decode row, on EVERY rank (collective at TP > 1), after everything
    else the run times: torch.profiler leaves the process's CUDA calls slower (step_timing.decode_kernels). Rank 0
    adds them to its rows (`decode`; None on the other ranks) and prints them."""
    counts = [step_timing.decode_kernels(runner, b, args.context) for b in ints(args.batch_sizes)]
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
