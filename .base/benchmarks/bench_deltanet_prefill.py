"""GPU micro-benchmark of the DeltaNet prefill ops (layers/deltanet_prefill.py): torch oracle vs Triton, one layer
at the Qwen3.5-35B-A3B shapes of one rank, bf16 inputs, fp32 states, fresh sequences.

    python -m benchmarks.bench_deltanet_prefill [--tp 1] [--sweep] [--out results.json]

Workloads as the engine runs them: S sequences of L tokens packed in steps of at most --step-tokens tokens (8192),
each step one call per op; times are for all steps of one layer, "x layers" for all DeltaNet layers of the model.
Ops: conv1d, delta_rule, and the elementwise ends of the layer's prefill path: gates (g and beta from the raw a, b
of the fused projection: layers/deltanet.py gates_torch / gates_fast) and gated_norm (layers/norm.py).
--sweep also times the launch settings of the delta rule's kernels and of the conv.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from layers import deltanet as dn
from layers import deltanet_prefill as dp
from layers import norm
from qwen35.config import ModelConfig
from qwen35.synth import PRESETS

WORKLOADS = [(1, 1024), (8, 1024), (64, 1024)]


def shapes(tp: int) -> dict:
    cfg = ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})
    Hk, Hv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return dict(Hk=Hk, Hv=Hv, dk=dk, dv=dv, K=cfg.linear_conv_kernel_dim, C=2 * Hk * dk + Hv * dv,
                layers=len(cfg.linear_attention_layers))


def step_inputs(s: dict, seqs: int, length: int, gen: torch.Generator) -> dict:
    """One step: `seqs` fresh sequences of `length` tokens, conv output laid out as the layer splits it."""
    N, dev = seqs * length, "cuda"
    u = torch.randn(N, s["C"], generator=gen, device=dev).bfloat16()
    q, k, v = u.split([s["Hk"] * s["dk"], s["Hk"] * s["dk"], s["Hv"] * s["dv"]], -1)
    return dict(
        u=u, weight=torch.randn(s["C"], 1, s["K"], generator=gen, device=dev).bfloat16() * 0.5,
        q=q.view(N, s["Hk"], s["dk"]), k=k.view(N, s["Hk"], s["dk"]), v=v.view(N, s["Hv"], s["dv"]),
        g=torch.nn.functional.logsigmoid(torch.randn(N, s["Hv"], generator=gen, device=dev) - 1.0),
        beta=torch.rand(N, s["Hv"], generator=gen, device=dev),
        cu=torch.arange(0, N + 1, length, dtype=torch.int32, device=dev),
        start=torch.zeros(seqs, dtype=torch.int32, device=dev), slots=torch.arange(seqs, device=dev),
        # z | b | a of the fused projection (strided views, as the layer passes them), the delta rule's output o
        zba=torch.randn(N, s["Hv"] * s["dv"] + 2 * s["Hv"], generator=gen, device=dev).bfloat16(),
        o=torch.randn(N, s["Hv"], s["dv"], generator=gen, device=dev).bfloat16(),
        A_log=torch.rand(s["Hv"], generator=gen, device=dev) - 0.5,
        dt_bias=torch.randn(s["Hv"], generator=gen, device=dev).bfloat16(),
        norm_w=torch.rand(s["dv"], generator=gen, device=dev) + 0.5,
        conv_state=torch.zeros(seqs, s["C"], s["K"] - 1, dtype=torch.bfloat16, device=dev),
        ssm_state=torch.zeros(seqs, s["Hv"], s["dk"], s["dv"], dtype=torch.float32, device=dev))


def conv_call(fn, x):
    return lambda: fn(x["u"], x["cu"], x["start"], x["conv_state"], x["slots"], x["weight"])


def delta_call(fn, x, scale):
    return lambda: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["start"], x["ssm_state"], x["slots"],
                      scale)


def gates_call(fn, x, s):
    b = x["zba"][:, s["Hv"] * s["dv"]:s["Hv"] * s["dv"] + s["Hv"]]
    a = x["zba"][:, s["Hv"] * s["dv"] + s["Hv"]:]
    return lambda: fn(a, b, x["A_log"], x["dt_bias"])


def norm_call(fn, x, s):
    z = x["zba"][:, :s["Hv"] * s["dv"]].unflatten(-1, (s["Hv"], s["dv"]))
    return lambda: fn(x["o"], z, x["norm_w"], 1e-6)


def bench(fn, rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="local shapes of one rank at this TP degree")
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch settings")
    ap.add_argument("--profile", action="store_true", help="also print each kernel's time (torch.profiler)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    s = shapes(args.tp)
    scale = s["dk"] ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}: Hk={s['Hk']} Hv={s['Hv']} dk={s['dk']} dv={s['dv']} "
          f"C={s['C']}, {s['layers']} DeltaNet layers; fast config {dp.FAST_CONFIG}")
    print(f"{'op':<12}{'seqs x len':>12}{'steps':>6}{'torch ms':>10}{'fast ms':>9}{'x':>7}{'GB/s':>7}"
          f"{'fast ms x layers':>18}{'tok/s x layers':>16}")
    rows = []
    for seqs, length in WORKLOADS:
        per_step = max(1, min(seqs, args.step_tokens // length))
        steps = -(-seqs // per_step)
        x = step_inputs(s, per_step, length, gen)
        tokens = seqs * length
        conv_bytes = 2 * x["u"].numel() * x["u"].element_size()         # read u, write the output
        ops = (("conv1d", dp.causal_conv1d_varlen_torch, dp.causal_conv1d_varlen_fast, lambda fn: conv_call(fn, x),
                conv_bytes),
               ("delta_rule", dp.chunk_delta_rule_varlen_torch, dp.chunk_delta_rule_varlen_fast,
                lambda fn: delta_call(fn, x, scale), None),  # not memory-bound
               ("gates", dn.gates_torch, dn.gates_fast, lambda fn: gates_call(fn, x, s),
                x["u"].shape[0] * s["Hv"] * (2 * 2 + 2 * 4)),  # read a, b (bf16), write g, beta (fp32)
               ("gated_norm", norm.gated_rms_norm_torch, norm.gated_rms_norm_fast, lambda fn: norm_call(fn, x, s),
                3 * x["o"].numel() * 2))  # read o, z, write y (bf16)
        for op, torch_fn, fast_fn, call, nbytes in ops:
            t_torch = bench(call(torch_fn), 200) * steps
            t_fast = bench(call(fast_fn), 200) * steps
            gbs = nbytes * steps / t_fast / 1e6 if nbytes else None
            total = t_fast * s["layers"]
            print(f"{op:<12}{f'{seqs} x {length}':>12}{steps:>6}{t_torch:>10.3f}{t_fast:>9.3f}"
                  f"{t_torch / t_fast:>7.1f}{'-' if gbs is None else f'{gbs:.0f}':>7}{total:>18.2f}"
                  f"{tokens / total * 1e3:>16.0f}")
            rows.append(dict(op=op, seqs=seqs, len=length, steps=steps, torch_ms=t_torch, fast_ms=t_fast,
                             gb_s=gbs, layers_ms=total))
        if args.profile:
            profile_kernels(x, scale, f"{seqs} x {length}")
        if args.sweep and (seqs, length) == (8, 1024):
            sweep(x, scale, steps, f"{seqs} x {length}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tp": args.tp, "config": dp.FAST_CONFIG,
                       "rows": rows}, f, indent=1)


def profile_kernels(x, scale, label):
    """GPU time per kernel of one step of the fast conv and delta rule."""
    from torch.profiler import ProfilerActivity, profile
    calls = (conv_call(dp.causal_conv1d_varlen_fast, x), delta_call(dp.chunk_delta_rule_varlen_fast, x, scale))
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in calls:
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"  kernels of one step, {label}: " + ", ".join(
        f"{e.key} {e.self_device_time_total / 1e3:.3f} ms" for e in sorted(events, key=lambda e: e.key)))


def sweep(x, scale, steps, label):
    """Launch settings for one workload (ms of all steps of one layer): the delta rule's three kernels one after
    another (state kernel: value block, warps, pipelining; output kernel: value block, warps; prep kernel: warps),
    each at the best of the ones before, then the conv's token and channel blocks."""
    saved = dict(dp.FAST_CONFIG)

    def run(fn, results, **settings):
        dp.FAST_CONFIG.update(saved, **settings)
        try:
            t = bench(fn, 100) * steps
        except Exception as e:  # a setting this Triton cannot compile (e.g. out of shared memory)
            print(f"  {settings}: {type(e).__name__}")
            return
        results.append((t, dict(settings)))
        print(f"    {t:8.3f} ms  {settings}", flush=True)  # as it goes: a setting that faults names itself

    delta = delta_call(dp.chunk_delta_rule_varlen_fast, x, scale)
    results = []
    for block_v in (16, 32, 64):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                if block_v * 8 < warps * 32:  # fewer value columns than warps can tile: Triton 3.6 faults here
                    continue
                run(delta, results, block_v=block_v, warps_state=warps, stages=stages)
    best = min(results, key=lambda r: r[0])[1] if results else {}
    for block_v_out in (32, 64, 128):
        for warps in (4, 8):
            run(delta, results, **best, block_v_out=block_v_out, warps_out=warps)
    best = min(results, key=lambda r: r[0])[1] if results else {}
    for warps in (2, 4, 8):
        run(delta, results, **dict(best, warps_prep=warps))
    conv = []
    for block_t in (16, 32, 64, 128):
        for block_c in (32, 64, 128, 256):
            run(conv_call(dp.causal_conv1d_varlen_fast, x), conv, conv_block_t=block_t, conv_block_c=block_c)
    dp.FAST_CONFIG.clear()
    dp.FAST_CONFIG.update(saved)
    for name, res in (("delta_rule", results), ("conv1d", conv)):
        res.sort(key=lambda r: r[0])
        print(f"  sweep {name} {label}:")
        for t, settings in res[:4]:
            print(f"    {t:8.3f} ms  {settings}")


if __name__ == "__main__":
    main()
