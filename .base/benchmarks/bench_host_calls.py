"""What the CUDA calls of a step cost the host (us per call), beside the engine's host time per step (issue #10):
the token copy to pinned memory, an event record, an event query, the pinned tokens to a list.

    python -m benchmarks.bench_host_calls [--rows 1,64] [--calls 2000]
"""
from __future__ import annotations

import argparse
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = 1e6 * (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return us


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    ev = torch.cuda.Event()
    print(f"{torch.cuda.get_device_name()}: us per call (host)")
    print(f"{'rows':>5} {'copy_':>7} {'record':>7} {'query':>7} {'tolist':>7} {'replay':>7}")
    for n in (int(x) for x in args.rows.split(",")):
        dev = torch.arange(n, device="cuda")
        host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        static = torch.zeros(n, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.add_(1)
        row = [per_call_us(lambda: host.copy_(dev, non_blocking=True), args.calls),
               per_call_us(ev.record, args.calls), per_call_us(ev.query, args.calls),
               per_call_us(host.tolist, args.calls), per_call_us(graph.replay, args.calls)]
        print(f"{n:5d} " + " ".join(f"{v:7.2f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
