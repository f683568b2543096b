"""GPU micro-benchmark of the DeltaNet ops of a speculative verify step (layers/deltanet_verify.py) at the
Qwen3.5-35B-A3B shapes of one rank: verify_fast (one layer: each sequence's pending drafts, then its T tokens; the state
read once and written after the first token) and commit_fast (every DeltaNet layer in one launch: the conv tails moved
on), by CUDA-graph replay, against the bytes the verify must move (fp32 state slabs read and written; the proj rows,
tails, replay rows and outputs are small).

    python -m benchmarks.bench_deltanet_verify [--tp 1] [--batches 1,8,32,64] [--T 2,3,4] [--accepted 0.6]
                                               [--sweep] [--out results.json]

Each sequence accepts round(accepted * (T - 1)) drafts (counts = that + 1), the same in every layer, and has as
many pending from the step before (the steady state). "% copy" is GB/s against a device-to-device copy measured in the
same run. --sweep also times both ops per launch setting (value columns per program x warps; the defaults come from
deltanet.decode_launch) at every row.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time

import torch
import triton.testing

from benchmarks.bench_deltanet import copy_rate_gbs, model_config
from layers import deltanet as dn, deltanet_verify as dvf
from layers.deltanet import decode_launch, replay_width

WARPS = (1, 2, 4, 8)
BLOCK_V = (16, 32, 64, 128)


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20)


class Layers:
    """L DeltaNet layers' caches and weights for B sequences of T tokens (random, bf16 proj and tails, fp32 states)."""

    def __init__(self, cfg, tp: int, L: int, B: int, T: int, counts: int, gen: torch.Generator):
        Hk, Hv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        conv_dim = 2 * Hk * dk + Hv * dv
        dev = dict(device="cuda")
        rnd = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=gen, **dev).to(dtype)  # noqa: E731
        self.slots = torch.randperm(B + 1, generator=gen, **dev)[:B]
        self.counts = torch.full((B,), counts, dtype=torch.int64, **dev)
        self.pending = torch.full((B + 1,), counts - 1, dtype=torch.int64, **dev)
        self.T, self.B, self.L = T, B, L
        self.layers = []
        for _ in range(L):
            proj = rnd(B * T, conv_dim + Hv * dv + 2 * Hv)
            self.layers.append(dict(proj=proj, conv=rnd(B + 1, conv_dim, K - 1),
                                    ssm=rnd(B + 1, Hv, dk, dv, dtype=torch.float32) * 0.1,
                                    conv_w=rnd(conv_dim, 1, K), A_log=rnd(Hv, dtype=torch.float32),
                                    dt_bias=rnd(Hv, dtype=torch.float32), norm=rnd(dv),
                                    replay=rnd(B + 1, T - 1, replay_width(Hk, Hv, dk, dv)) * 0.1))
        self.state_bytes = B * Hv * dk * dv * 4  # one layer's slabs of the batch

    def verify(self, l: int = 0):
        x = self.layers[l]
        return dvf.verify_fast(x["proj"], x["conv"], x["ssm"], self.slots, x["conv_w"], x["A_log"], x["dt_bias"],
                               x["norm"], 1e-6, self.T, x["replay"], self.pending, row=l)

    def steps(self) -> list:
        return [dvf.VerifyStep(x["proj"], x["conv"], self.slots, self.T, l) for l, x in enumerate(self.layers)]


def timed(layers: Layers, steps) -> tuple[float, float]:
    """(verify ms of one layer, commit ms of every layer), with the launch setting in force."""
    for l in range(layers.L):  # every layer's row of the commit table
        layers.verify(l)
    t_verify = bench(lambda: layers.verify(0))
    for l in range(layers.L):  # (verify(0) rewrote row 0 with the same tensors)
        layers.verify(l)
    t_commit = bench(lambda: dvf.commit_fast(steps, layers.counts))
    return t_verify, t_commit


@contextlib.contextmanager
def with_launch(setting):
    """The DeltaNet's one-launch kernels (deltanet_verify's and deltanet.decode_fast) take `setting` (block_v, warps)
    whatever the rows (None: the default)."""
    saved = dvf.decode_launch
    if setting is not None:
        dn.decode_launch = dvf.decode_launch = lambda dk, dv, rows=1: (min(setting[0], dv), setting[1])
    try:
        yield
    finally:
        dn.decode_launch = dvf.decode_launch = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--T", default="2,3,4")
    ap.add_argument("--accepted", type=float, default=0.6, help="the fraction of drafts each sequence accepts")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = model_config()
    L = cfg.layer_types.count("linear_attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}, {L} DeltaNet layers; copy {copy:.0f} GB/s")
    print(f"{'B':>3} {'T':>2} {'n':>2} {'setting':>8} {'verify us':>10} {'% copy':>7} {'commit us':>10}")
    rows = []
    for B, T in itertools.product(map(int, args.batches.split(",")), map(int, args.T.split(","))):
        n = 1 + round(args.accepted * (T - 1))
        layers = Layers(cfg, args.tp, L, B, T, n, gen)
        steps = layers.steps()
        dk = cfg.linear_key_head_dim
        default = decode_launch(dk, cfg.linear_value_head_dim, B)
        settings = [None] + ([(bv, w) for bv, w in itertools.product(BLOCK_V, WARPS)
                              if bv * dk // (32 * w) <= 128 and (bv, w) != default] if args.sweep else [])
        for setting in settings:
            with with_launch(setting):
                tv, tc = timed(layers, steps)
            pv = 2 * layers.state_bytes / tv / 1e6 / copy * 100  # the slabs read and written
            name = "%d/%d%s" % (*(setting or default), "*" if setting is None else "")
            print(f"{B:>3} {T:>2} {n:>2} {name:>8} {tv * 1e3:>10.1f} {pv:>7.1f} {tc * 1e3:>10.1f}", flush=True)
            rows.append({"batch": B, "T": T, "counts": n, "block_v": (setting or default)[0],
                         "warps": (setting or default)[1], "default": setting is None,
                         "verify_us": round(tv * 1e3, 2), "commit_us": round(tc * 1e3, 2),
                         "verify_pct_copy": round(pv, 1)})
        del layers, steps
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "tp": args.tp,
                       "copy_gbs": round(copy),
                       "command": "python -m benchmarks.bench_deltanet_verify " + " ".join(sys.argv[1:]),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
