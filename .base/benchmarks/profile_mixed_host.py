"""Where an eager step's time goes: the host's time to queue a prefill or mixed step (the steps that admit a request,
run without CUDA graphs) against the step's device time, and the host's time by function (cProfile, rank 0).

    torchrun --nproc-per-node N -m benchmarks.profile_mixed_host [--layers 8] [--steps prefill:1x1024,mixed:8+1x64]

A step `prefill:SxL` is S fresh prompts of L tokens; `mixed:D+SxL` is D decode rows (one token each, context 512)
beside S prompt tails of L tokens. Per step: `queue ms` (the host, from the call until the forward and the LM head
are queued), `total ms` (until the device has run them), the kernels the step launches, and the best of --reps.
Where queue ~ total, the host bounds the step. Full-size dummy weights of --model; --layers N keeps the first N
layers (the host's cost per layer is what matters; loading all 40 takes minutes).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

from dist import parallel
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import preset_text
from scheduler.plan import StepPlan

CONTEXT = 512  # decode rows' context


def parse_step(spec: str) -> tuple[int, int, int]:
    """'prefill:SxL' -> (0, S, L); 'mixed:D+SxL' -> (D, S, L)."""
    kind, shape = spec.split(":")
    decode, _, prompts = shape.rpartition("+") if kind == "mixed" else ("0", "", shape)
    seqs, length = (int(v) for v in prompts.split("x"))
    return int(decode or 0), seqs, length


def make_plan(runner: ModelRunner, decode: int, seqs: int, length: int) -> StepPlan:
    blocks = -(-max(CONTEXT + 1, length) // runner.block_size)
    rows = decode + seqs
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(1000, 50000, (rows, max(length, 1)), generator=gen).tolist()
    return StepPlan(state_slots=list(range(rows)),
                    token_ids=[ids[i][:1] for i in range(decode)] + [ids[i][:length] for i in range(decode, rows)],
                    start_pos=[CONTEXT] * decode + [0] * seqs,
                    block_tables=[list(range(i * blocks, (i + 1) * blocks)) for i in range(rows)],
                    want_logits=[True] * rows)


def queue(runner: ModelRunner, plan: StepPlan):
    hidden, batch = runner._forward(plan)
    return runner.model.compute_logits(hidden if batch is None else hidden[batch.logits_indices], gather="none")


def time_step(runner: ModelRunner, plan: StepPlan, reps: int) -> tuple[float, float]:
    best_q, best_t = float("inf"), float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        parallel.barrier()
        t0 = time.perf_counter()
        queue(runner, plan)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        best_q, best_t = min(best_q, t1 - t0), min(best_t, t2 - t0)
    return best_q * 1e3, best_t * 1e3


def kernels(runner: ModelRunner, plan: StepPlan) -> int:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        queue(runner, plan)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", default="prefill:1x1024,prefill:1x64,mixed:8+1x64,mixed:32+1x64,mixed:8+1x12")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="cProfile rows (rank 0, the first step)")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = ap.parse_args()
    parallel.init_distributed("cuda")
    cfg = ModelConfig.from_dict({"text_config": preset_text(args.model, args.layers)})
    steps = [parse_step(s) for s in args.steps.split(",")]
    rows = max(d + s for d, s, _ in steps)
    max_len = max([CONTEXT + 64] + [n + 64 for _, _, n in steps])
    runner = ModelRunner(cfg, EngineArgs(model=args.model, load_format="dummy", device="cuda",
                                         max_num_seqs=max(rows, 8), max_model_len=max_len,
                                         num_kv_blocks=rows * -(-max_len // 16) + 64))
    driver = parallel.is_driver()
    results = {"device": torch.cuda.get_device_name(), "tp": parallel.tp_size(), "model": args.model,
               "layers": cfg.num_hidden_layers, "date": time.strftime("%Y-%m-%d"),
               "command": "benchmarks.profile_mixed_host " + " ".join(sys.argv[1:]), "steps": []}
    if driver:
        print(f"{torch.cuda.get_device_name()} tp={parallel.tp_size()} layers={cfg.num_hidden_layers}")
        print(f"{'step':>16} {'queue ms':>9} {'total ms':>9} {'kernels':>8} {'queue us/layer':>15}")
    for spec, (d, s, n) in zip(args.steps.split(","), steps):
        plan = make_plan(runner, d, s, n)
        for _ in range(2):
            queue(runner, plan)  # compiles
        q, t = time_step(runner, plan, args.reps)
        k = kernels(runner, plan)
        results["steps"].append({"step": spec, "queue_ms": round(q, 3), "total_ms": round(t, 3), "kernels": k})
        if driver:
            print(f"{spec:>16} {q:9.2f} {t:9.2f} {k:8d} {1e3 * q / cfg.num_hidden_layers:15.1f}", flush=True)
    if driver and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    d, s, n = steps[0]
    plan = make_plan(runner, d, s, n)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    queue(runner, plan)
    prof.disable()
    torch.cuda.synchronize()
    if driver:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"--- cProfile of {args.steps.split(',')[0]} (host only), by own time")
        print(out.getvalue())
    parallel.destroy()


if __name__ == "__main__":
    main()
