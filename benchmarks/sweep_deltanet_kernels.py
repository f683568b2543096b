"""The DeltaNet's one-launch kernels per launch setting, with the registers and spills of each compiled variant: the
decode (with and without a pending draft to replay first) and the speculative verify (T tokens, pending drafts),
one layer at the Qwen3.5-35B-A3B shapes of one rank (--tp), by CUDA-graph replay, against the state bytes a launch
must move (fp32 slabs read and written) as % of a device-to-device copy. A setting's rank in a sweep is not its rank
in a step: with L2 flushed before every call (tune_moe.cold_graph_ms), 32 x 2 warps ran 5-40% faster than the
defaults at every batch, and the TP=2 decode record with it was 0.0-0.5% slower (2026-11-30, docs/journal.md).

    python -m benchmarks.sweep_deltanet_kernels [--tp 1] [--settings 32/1,64/2] [--batches 8,64]
                                                [--decode-only | --verify-only]

A setting is value columns per program / warps (deltanet.decode_launch, which both kernels take). Registers and
spills come from Triton's compiled kernels (`n_regs`, `n_spills`): at 255 registers a variant spills, and the
spills, not the arithmetic, were what held the verify kernel (2026-11-29, docs/journal.md).
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from benchmarks.bench_deltanet import copy_rate_gbs, model_config
from benchmarks.bench_deltanet_verify import Layers, with_launch
from layers import deltanet as dn, deltanet_verify as dvf

# (T, drafts accepted + 1): a decode step alone (T = 1, counts 1) or after one pending draft (counts 2), then verify
CASES = ((1, 1), (1, 2), (2, 2), (3, 2), (4, 3))


def compiled(fn) -> list[tuple[int, int, int]]:
    """(warps, registers, spills) of every variant of a Triton kernel compiled so far."""
    out = []
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        out += [(k.metadata.num_warps, k.n_regs, k.n_spills) for k in cache.values()]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="the shapes of one rank of this TP")
    ap.add_argument("--settings", default="16/1,16/2,32/1,32/2,32/4,64/2,64/4,64/8,128/4,128/8")
    ap.add_argument("--batches", default="8,64")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--verify-only", action="store_true", help="only the verify rows (T >= 2)")
    only.add_argument("--decode-only", action="store_true", help="only the decode rows (no replay)")
    args = ap.parse_args()
    settings = [tuple(map(int, s.split("/"))) for s in args.settings.split(",")]
    cfg = model_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}; copy {copy:.0f} GB/s")
    cases = CASES[:1] if args.decode_only else CASES[2:] if args.verify_only else CASES
    for B in map(int, args.batches.split(",")):
        for T, counts in cases:
            layers = Layers(cfg, args.tp, 1, B, max(T, 2), counts, gen)
            x = layers.layers[0]
            proj = x["proj"][:B].contiguous()  # (a decode step's rows)
            replay = counts > 1
            if T == 1:
                name = "decode" + ("+replay" if replay else "")
                fn = lambda: dn.decode_fast(  # noqa: E731
                    proj, x["conv"], x["ssm"], layers.slots, x["conv_w"], x["A_log"], x["dt_bias"], x["norm"], 1e-6,
                    replay=x["replay"] if replay else None, pending=layers.pending if replay else None)
            else:
                name = f"verify T={T} p={counts - 1}"
                fn = lambda: layers.verify(0)  # noqa: E731
            for bv, warps in settings:
                with with_launch((bv, warps)):
                    fn()
                    t = triton.testing.do_bench_cudagraph(fn, rep=15)
                pct = 2 * layers.state_bytes / t / 1e6 / copy * 100
                print(f"B={B:>2} {name:<16} {bv:>3}/{warps} {t * 1e3:8.1f} us {pct:5.1f}%", flush=True)
            del layers
    for name, fn in (("decode", dn._decode_kernel), ("verify", dvf._verify_kernel)):
        for warps, regs, spills in compiled(fn):
            print(f"{name} kernel, {warps} warps: {regs} registers, {spills} spilled")


if __name__ == "__main__":
    main()
