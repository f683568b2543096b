"""Where a create_engine decode call goes (issue #29 item 1): per batch size, the wall time of a call, the device
time of its kernels and the host time around them, and the kernels that take it, from torch.profiler.

    python -m benchmarks.profile_decode_calls [--model llama-1b] [--batches 1,8,32,64] [--context 1024]
        [--calls 20] [--top 12] [--json out.json]

Requests are prefilled to --context tokens (random ids, dummy weights), then decoded by argmax as the harness does
(qwen35/bench/harness.py decode_rows). The wall time per call is taken without the profiler; the profiler then runs
--calls more calls and reports per call: kernels launched, the sum of their device times (busy), and per kernel
name its share.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from qwen35.api import create_engine
from qwen35.hub import resolve_model


def kernel_times(prof, calls: int) -> tuple[dict[str, float], float]:
    """Per kernel name its device ms per call, and the launches per call, from a torch.profiler run of `calls`
    calls."""
    per_name, launches = defaultdict(float), 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name] += ev.device_time_total / calls / 1e3
            launches += 1
    return per_name, launches / calls


def profile_batch(eng, b: int, context: int, calls: int, top: int, vocab: int, gen: torch.Generator) -> dict:
    ids = [f"r{b}-{i}" for i in range(b)]
    per_call = max(1, 16384 // context)
    last = [eng.prefill(ids[s:s + per_call], [torch.randint(0, vocab, (context,), generator=gen)
                                              for _ in ids[s:s + per_call]]) for s in range(0, b, per_call)]
    tokens = torch.cat(last).argmax(-1)
    for _ in range(3):  # warm
        tokens = eng.decode(ids, tokens).argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        tokens = eng.decode(ids, tokens).argmax(-1)
    torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - t0) / calls
    # host time of one call alone: the device idle before it (synchronize), so the call's Python is all host
    host = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.decode(ids, tokens)
        host.append(time.perf_counter() - t0)
        tokens = out.argmax(-1)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            tokens = eng.decode(ids, tokens).argmax(-1)
        torch.cuda.synchronize()
    per_name, launches = kernel_times(prof, calls)
    eng.remove(ids)
    busy = sum(per_name.values())
    kernels = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"batch": b, "context": context, "wall_ms": round(wall_ms, 3),
            "host_ms_per_call": round(1e3 * sorted(host)[len(host) // 2], 3),
            "busy_ms": round(busy, 3), "kernels_per_call": round(launches, 1),
            "top": [{"name": n[:90], "ms": round(t, 4)} for n, t in kernels]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = resolve_model(args.model, load_format="dummy")
    with open(f"{model_dir}/config.json") as f:
        raw = json.load(f)
    t0 = time.perf_counter()
    eng = create_engine(raw, None, device="cuda", load_format="dummy", max_num_seqs=max(batches),
                        max_model_len=args.context + 4 * args.calls + 16)
    created = time.perf_counter() - t0
    vocab = eng.runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = [profile_batch(eng, b, args.context, args.calls, args.top, vocab, gen) for b in batches]
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
           "command": "python -m benchmarks.profile_decode_calls " + " ".join(
               f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
           "create_engine_s": round(created, 1), "rows": rows}
    print(f"{out['device']}  {args.model}  create_engine {created:.1f} s")
    for r in rows:
        print(f"batch {r['batch']:3d}: wall {r['wall_ms']:.3f} ms/call, host {r['host_ms_per_call']:.3f}, "
              f"busy {r['busy_ms']:.3f}, {r['kernels_per_call']} kernels/call")
        for k in r["top"]:
            print(f"    {k['ms'] * 1e3:8.1f} us  {k['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
