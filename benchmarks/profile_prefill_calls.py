"""Where a create_engine prefill call goes (issue #29's mixed trace: prefill calls of 1-4 new prompts): per shape,
the wall time of a call, the device time of its kernels, and the kernels that take it, from torch.profiler.

    python -m benchmarks.profile_prefill_calls [--model llama-1b] [--shapes 1x1024,1x2048,4x1024,8x2048]
        [--calls 5] [--top 12] [--json out.json]

Each call prefills fresh requests of random ids (dummy weights) and reads the last token's argmax, as the harness's
mixed trace does (qwen35/bench/harness.py mixed_trace); the requests are removed after it. The wall time per call is
taken without the profiler, the kernels with it over as many more calls.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.profile_decode_calls import kernel_times
from qwen35.api import create_engine
from qwen35.hub import resolve_model


def profile_shape(eng, n: int, length: int, calls: int, top: int, vocab: int, gen: torch.Generator) -> dict:
    count = iter(range(1 << 30))

    def call():
        ids = [f"p{n}x{length}-{next(count)}" for _ in range(n)]
        eng.prefill(ids, [torch.randint(0, vocab, (length,), generator=gen) for _ in ids]).argmax(-1).tolist()
        eng.remove(ids)

    call()  # warm
    walls = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per_name, launches = kernel_times(prof, calls)
    busy = sum(per_name.values())
    wall_ms = 1e3 * sorted(walls)[len(walls) // 2]
    return {"seqs": n, "len": length, "wall_ms": round(wall_ms, 3), "busy_ms": round(busy, 3),
            "tok_s": round(n * length / wall_ms * 1e3), "launches": round(launches, 1),
            "kernels": [{"name": k[:100], "ms": round(v, 3)} for k, v in
                        sorted(per_name.items(), key=lambda kv: -kv[1])[:top]]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--shapes", default="1x1024,1x2048,4x1024,8x2048", help="SEQSxLEN,...")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model_dir = resolve_model(args.model, load_format="dummy")
    with open(f"{model_dir}/config.json") as f:
        raw = json.load(f)
    t0 = time.perf_counter()
    eng = create_engine(raw, None, device="cuda", load_format="dummy", max_num_seqs=max(n for n, _ in shapes),
                        max_model_len=max(length for _, length in shapes) + 16,
                        max_num_batched_tokens=max(n * length for n, length in shapes))
    print(f"create_engine {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = eng.runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, length in shapes:
        r = profile_shape(eng, n, length, args.calls, args.top, vocab, gen)
        rows.append(r)
        print(f"prefill {n} x {length}: {r['wall_ms']:.2f} ms a call ({r['tok_s']} tok/s), kernels busy "
              f"{r['busy_ms']:.2f} ms, {r['launches']} launches", flush=True)
        for k in r["kernels"]:
            print(f"    {k['ms']:8.3f} ms  {k['name']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
