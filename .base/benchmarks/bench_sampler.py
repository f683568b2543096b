"""GPU micro-benchmark of one step's sampling (layers/sampler.py), alone or under torchrun at any TP:

    python -m benchmarks.bench_sampler [--batch 1,8,64] [--vocab 248320] [--real 248077] [--out results.json]
    torchrun --nproc-per-node 8 -m benchmarks.bench_sampler ...

Per batch size and mode (greedy; temperature 1; temperature 1 + top-p 0.95; temperature 0.8 + top-k 50 + top-p
0.9), microseconds per step (the slowest rank) of
    gathered   sample_torch: every rank all-gathers the logits rows and samples them whole (the reference)
    sharded    sample_fast: each rank's vocabulary shard, a Triton pass and an all-gather of a few candidates
from logits already on the device (this rank's shard, fp32, as the LM head leaves them), eager as the engine runs
it. Before timing, the two are checked to give the same tokens on every rank ("ok" in the row; the process exits
non-zero if one is not).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as torch_dist

from dist import parallel
from layers.linear import even_split
from layers.sampler import SampleBatch, sample_fast, sample_torch

MODES = {  # temperature, top_k, top_p
    "greedy": (0.0, 0, 1.0),
    "temperature": (1.0, 0, 1.0),
    "top_p": (1.0, 0, 0.95),
    "top_k_top_p": (0.8, 50, 0.9),
}


def make_batch(mode: str, rows: int, step: int) -> SampleBatch:
    t, k, p = MODES[mode]
    full = lambda v: torch.full((rows,), float(v), device="cuda")  # noqa: E731
    return SampleBatch(full(t), full(k), full(p), torch.arange(rows, device="cuda") * 7919,
                       torch.full((rows,), step, dtype=torch.int64, device="cuda"), None,
                       greedy_only=t == 0, any_top_k=t > 0 and k > 0, any_top_p=t > 0 and p < 1)


def time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    parallel.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end)], device="cuda")
    if parallel.tp_size() > 1:
        torch_dist.all_reduce(ms, op=torch_dist.ReduceOp.MAX)
    return ms.item() * 1000 / reps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,64", help="comma-separated rows per step")
    p.add_argument("--vocab", type=int, default=248320, help="padded vocabulary (the LM head's rows)")
    p.add_argument("--real", type=int, default=248077, help="ids below this are tokens, the rest padding")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = p.parse_args()
    rank, world = parallel.init_distributed("cuda")
    start, size = even_split(args.vocab, rank, world)
    rows, failed = [], False
    for b in [int(x) for x in args.batch.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(b)  # the same full logits on every rank: each takes its shard
        logits = (torch.randn(b, args.vocab, device="cuda", generator=gen) * 3)[:, start:start + size].contiguous()
        for mode in MODES:
            ok = True
            for step in range(3):
                batch = make_batch(mode, b, step)
                fast = sample_fast(logits, batch, args.real, args.vocab)
                ref = sample_torch(logits, batch, args.real, args.vocab)
                ok &= torch.equal(fast, ref) and bool((parallel.all_gather(fast) == fast).all())
            failed |= not ok
            batch = make_batch(mode, b, 0)
            row = {"batch": b, "mode": mode, "ok": ok,
                   "gathered us": round(time_us(lambda: sample_torch(logits, batch, args.real, args.vocab),
                                                args.reps), 1),
                   "sharded us": round(time_us(lambda: sample_fast(logits, batch, args.real, args.vocab),
                                               args.reps), 1)}
            rows.append(row)
            if rank == 0:
                print(f"batch {b:4d} {mode:12s} gathered {row['gathered us']:9.1f} us  sharded "
                      f"{row['sharded us']:9.1f} us{'' if ok else '  MISMATCH'}", flush=True)
    if rank == 0 and args.out:
        meta = {"device": torch.cuda.get_device_name(), "tp": world, "vocab": args.vocab, "real": args.real,
                "reps": args.reps, "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    parallel.destroy()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
