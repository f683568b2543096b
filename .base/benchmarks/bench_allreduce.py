"""GPU micro-benchmark of the layer-boundary all-reduce (dist/allreduce.py, layers/norm.py), under torchrun on 2+ GPUs:

    torchrun --nproc-per-node 8 -m benchmarks.bench_allreduce [--hidden 2048] [--tokens 1,2,4,8,16,32,64]
                                                              [--calls 64] [--out results.json]

For each message of tokens x hidden bf16 (one rank's partial sums at a layer boundary), microseconds per call, each
method captured --calls times in one CUDA graph and the graph replayed (as decode steps run):
    nccl          torch.distributed.all_reduce
    one_shot      every rank sums all peer buffers (symmetric memory)
    two_shot      reduce-scatter + all-gather through the peer buffers
    nccl+norm     the boundary without the fused kernel: NCCL, then add_rms_norm_fast
    fused         the boundary in one kernel: one-shot sum + residual add + RMSNorm
The one-shot / two-shot / fused columns run at every size that fits the workspace (whatever `choose` would pick),
so the table shows where the size thresholds (ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES) should sit; "choose" says
what the engine picks today. Timing data are zeros (sums of zeros stay zeros: in-place calls repeated in a graph
never overflow; the kernels do not depend on the values).

Before timing, each method is checked on random data against the sum every rank must compute (all ranks' inputs
gathered, summed in fp32 in rank order, rounded once): one-shot, two-shot and the fused residual bit-exact, the
fused output within one bf16 ulp, NCCL within bf16 rounding; every method's result identical on all ranks. A
failed check is reported in the row ("ok": false) and the process exits non-zero at the end.
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stay set (dist.parallel.init_distributed).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as torch_dist

from dist import allreduce, parallel
from layers.norm import add_rms_norm_fast, add_rms_norm_torch, fused_all_reduce_add_rms_norm

EPS = 1e-6


def rank_order_sum(parts):
    """The sum every rank must compute: fp32, ranks in order, rounded once to the parts' dtype (also the oracle of
    tests/test_allreduce.py)."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def gathered(x):
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size())]
    torch_dist.all_gather(parts, x.contiguous())
    return parts


def methods(ws, x, residual, w):
    """name -> a call on (x, residual) that does one boundary's communication (and norm), for sizes that fit."""
    def nccl():
        torch_dist.all_reduce(x)
        return x
    out = {"nccl": nccl, "nccl+norm": lambda: add_rms_norm_fast(nccl(), residual, w, EPS)}
    nbytes = x.numel() * x.element_size()
    if nbytes <= ws.data_bytes:
        out["one_shot"] = lambda: allreduce.one_shot_(x, ws)
        out["fused"] = lambda: fused_all_reduce_add_rms_norm(x, residual, w, EPS, ws)
    if ws.world * allreduce.two_shot_slice(x.numel(), ws.world) * x.element_size() <= ws.data_bytes:
        out["two_shot"] = lambda: allreduce.two_shot_(x, ws)
    return out


def check(ws, tokens, hidden, w, gen) -> list[str]:
    """Errors of every method on random data (empty: all correct)."""
    errors = []
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    residual = gathered(residual)[0]  # the residual stream is the same on every rank
    want = rank_order_sum(gathered(x))
    y_want, s_want = add_rms_norm_torch(want, residual, w, EPS)

    def same_everywhere(t):
        return all(torch.equal(p, t) for p in gathered(t))
    for name in ("one_shot", "two_shot", "nccl"):
        got = x.clone()
        fn = methods(ws, got, residual, w).get(name)
        if fn is None:
            continue
        fn()
        exact = torch.equal(got, want)
        if (name != "nccl" and not exact) or not same_everywhere(got) \
                or (got.float() - want.float()).abs().max().item() > 2 ** -7 * 4 * ws.world:
            errors.append(f"{name}: max diff {(got.float() - want.float()).abs().max().item():.3g}")
    if "fused" in methods(ws, x, residual, w):
        y, s = fused_all_reduce_add_rms_norm(x.clone(), residual, w, EPS, ws)
        if not torch.equal(s, s_want) or (y.float() - y_want.float()).abs().max().item() > 2 ** -7 * 8 \
                or not same_everywhere(y):
            errors.append(f"fused: residual diff {(s.float() - s_want.float()).abs().max().item():.3g}, "
                          f"output diff {(y.float() - y_want.float()).abs().max().item():.3g}")
    return errors


def time_us(fn, calls: int, reps: int = 20) -> float:
    fn()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    parallel.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end)], device="cuda")
    torch_dist.all_reduce(ms, op=torch_dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return ms.item() * 1000 / (reps * calls)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", default="1,2,4,8,16,32,64", help="comma-separated message rows")
    p.add_argument("--calls", type=int, default=64, help="calls per captured graph")
    p.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = p.parse_args()
    rank, world = parallel.init_distributed("cuda")
    if world < 2:
        raise SystemExit("run under torchrun with 2 or more GPUs (--nproc-per-node N)")
    tokens = [int(t) for t in args.tokens.split(",")]
    device = torch.device("cuda", torch.cuda.current_device())
    if not parallel.setup_symmetric_all_reduce(max(tokens) * args.hidden * 2, device):
        raise SystemExit("no symmetric-memory workspace (see the warning above)")
    ws = allreduce.current()
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    w = (torch.randn(args.hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 0.2)
    w = w.to(torch.bfloat16)
    rows, failed = [], False
    for t in tokens:
        errors = check(ws, t, args.hidden, w, gen)
        failed |= bool(errors)
        x = torch.zeros(t, args.hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.zeros_like(x)
        row = {"tokens": t, "bytes": x.numel() * 2, "choose": allreduce.choose(x, ws), "ok": not errors,
               "errors": errors}
        for name, fn in methods(ws, x, residual, w).items():
            row[f"{name} us"] = round(time_us(fn, args.calls), 2)
        rows.append(row)
        if rank == 0:
            cols = " ".join(f"{k[:-3]} {v:7.2f}" for k, v in row.items() if k.endswith(" us"))
            print(f"tokens {t:5d} ({row['bytes'] / 1024:8.1f} KiB) choose {row['choose']:10s} {cols}"
                  f"{'' if not errors else '  FAILED: ' + '; '.join(errors)}", flush=True)
    if rank == 0 and args.out:
        meta = {"device": torch.cuda.get_device_name(), "world": world, "hidden": args.hidden, "dtype": "bfloat16",
                "calls_per_graph": args.calls, "torch": torch.__version__,
                "one_shot_max_bytes": ws.one_shot_max_bytes, "workspace_data_bytes": ws.data_bytes}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    parallel.destroy()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
