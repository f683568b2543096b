"""Where a step's GPU time goes: torch.profiler over one prefill and a few decode steps of the full-size dummy model.

    python -m benchmarks.profile_step [--prefill-len 1024] [--prefill-seqs 1] [--decode-batch 1,64] [--layers 40]

Prints the top CUDA kernels (total time, calls) per phase. Eager mode, so that every kernel is visible.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from qwen35.config import ModelConfig
from qwen35.runner import ModelRunner
from qwen35.synth import PRESETS
from scheduler.plan import StepPlan


def top(prof, n: int, title: str) -> None:
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"--- {title}: {total / 1e3:.2f} ms of kernels")
    for e in events[:n]:
        print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-seqs", type=int, default=1)
    ap.add_argument("--decode-batch", default="1,64")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    raw = {"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])}
    raw["text_config"]["num_hidden_layers"] = args.layers
    raw["text_config"]["layer_types"] = raw["text_config"]["layer_types"][:args.layers]
    cfg = ModelConfig.from_dict(raw)
    batches = [int(b) for b in args.decode_batch.split(",")]
    runner = ModelRunner(cfg, load_format="dummy", device="cuda", max_num_seqs=max(batches + [args.prefill_seqs]),
                         max_model_len=args.prefill_len + 64, enforce_eager=True)
    nblk = -(-(args.prefill_len + 64) // runner.block_size)
    rows = max(batches + [args.prefill_seqs])
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(rows)]
    ids = torch.randint(0, 248000, (rows, args.prefill_len)).tolist()

    def prefill(seqs):
        return StepPlan(list(range(seqs)), ids[:seqs], [0] * seqs, tables[:seqs], [True] * seqs)

    for _ in range(2):  # warm-up: compiles, cuBLAS heuristics
        runner.execute(prefill(args.prefill_seqs))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.execute(prefill(args.prefill_seqs))
        torch.cuda.synchronize()
    top(prof, args.top, f"prefill {args.prefill_seqs} x {args.prefill_len}")
    for b in batches:
        runner.execute(prefill(b))
        plan = StepPlan(list(range(b)), [[5]] * b, [args.prefill_len] * b, tables[:b], [True] * b)
        runner.execute(plan)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.execute(plan)
            torch.cuda.synchronize()
        top(prof, args.top, f"3 decode steps at batch {b}")


if __name__ == "__main__":
    main()
