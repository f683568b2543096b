"""Where a step's GPU time goes: torch.profiler over one prefill and a few decode steps of the full-size dummy model.

    python -m benchmarks.profile_step [--prefill-len 1024] [--prefill-seqs 1] [--decode-batch 1,64] [--layers 40]

Prints the top CUDA kernels (total time, calls) per phase. Eager mode, so that every kernel is visible; with
--graphs the decode steps replay CUDA graphs (as served), and the kernels' busy time is set beside the step's span:
what is left is the time between kernels (launch gaps, ramps).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
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


def gaps_per_step(prof, steps: int) -> None:
    """Kernel busy time against the span from a step's first kernel start to its last kernel's end (the steps are
    told apart by the host syncs between them: gaps over 200 us)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel")
    groups, cur = [], []
    for k in kernels:
        if cur and k[0] - (cur[-1][0] + cur[-1][1]) > 200:
            groups.append(cur)
            cur = []
        cur.append(k)
    if cur:
        groups.append(cur)
    for g in groups[-steps:]:
        span = g[-1][0] + g[-1][1] - g[0][0]
        busy = sum(d for _, d in g)
        idle = sorted(b[0] - (a[0] + a[1]) for a, b in zip(g, g[1:]))
        med = idle[len(idle) // 2] if idle else 0.0
        print(f"    step: {len(g)} kernels, span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f} ms, between "
              f"them {(span - busy) / 1e3:.3f} ms (median gap {med:.2f} us)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-seqs", type=int, default=1)
    ap.add_argument("--decode-batch", default="1,64")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--graphs", action="store_true", help="decode steps by CUDA graph replay, and their gaps")
    args = ap.parse_args()
    raw = {"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])}
    raw["text_config"]["num_hidden_layers"] = args.layers
    raw["text_config"]["layer_types"] = raw["text_config"]["layer_types"][:args.layers]
    cfg = ModelConfig.from_dict(raw)
    batches = [int(b) for b in args.decode_batch.split(",")]
    runner = ModelRunner(cfg, EngineArgs(model="", load_format="dummy", device="cuda",
                                         max_num_seqs=max(batches + [args.prefill_seqs]),
                                         max_model_len=args.prefill_len + 64, enforce_eager=not args.graphs))
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
                torch.cuda.synchronize()  # (steps apart: the gaps counted are those inside a step)
        top(prof, args.top, f"3 decode steps at batch {b}" + (" (CUDA graphs)" if args.graphs else ""))
        if args.graphs:
            gaps_per_step(prof, 3)


if __name__ == "__main__":
    main()
