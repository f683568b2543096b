"""GPU micro-benchmark of the Gated DeltaNet decode (layers/deltanet.py) and the out projections' skinny GEMM
(layers/linear.py): torch oracle vs Triton, one layer at the Qwen3.5-35B-A3B shapes of one rank, bf16 activations,
fp32 states.

    python -m benchmarks.bench_deltanet [--tp 1] [--sweep] [--out results.json]

Rows, for decode batches 1..64 (a DeltaNet step does not depend on the context length):
- decode_op: decode_torch vs decode_fast (conv step .. gated RMSNorm, states in place; one kernel), by CUDA-graph
  replay; GB/s counts the bytes the op must move (fp32 state read and written, conv tails, proj, y);
- layer: the whole mixer's decode step (one u|z|b|a GEMM, the decode op, out_proj), CUDA-graph replay; GB/s adds
  the two weights; "kernels" is the number of GPU activities of one eager step (torch/fast, torch.profiler). Before
  the one-kernel decode and the skinny out_proj (profile of 2026-11-23, 1x H200) the fast layer was 5 kernels at
  batch <= 8 (in_proj GEMM, conv step, delta step, cuBLAS split-K GEMM + its reduction) and 4 above;
- out_proj / o_proj: the row-parallel out projections of the DeltaNet and attention layers at M = batch rows,
  linear_torch (cuBLAS) vs linear_fast (the skinny Triton GEMM up to SKINNY_MAX_M rows, cuBLAS above); GB/s counts
  the weight, x and y; the last column multiplies by the layers of that kind;
- mixed: an eager mixed step of `batch` decode rows plus one fresh 128-token prompt, mixed_torch (per sequence) vs
  mixed_fast (decode rows through decode_fast in one call, the prompt through the stacked chunked rule).
"% copy" is GB/s against a device-to-device copy measured in the same run (the floor). --sweep also times
decode_fast per launch setting (value columns per program x warps) at every batch, and linear_fast per
setting (output columns per program, K step, warps, stages) at M = 1, 8 and 16, each with GB/s and % of copy.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton.runtime.errors
import triton.testing

from dist import parallel
from layers import backend
from layers import deltanet as dn
from layers import linear as lin
from layers.forward_batch import ForwardBatch
from qwen35.config import ModelConfig
from qwen35.synth import PRESETS

BATCHES = [1, 2, 4, 8, 16, 32, 64]
PROMPT = 128          # tokens of the fresh prompt in a mixed step
CONTEXT = 1024        # start position of the decode rows (for the record: the step does not depend on it)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SWEEP_ROWS = (1, 8, 16)    # M of the skinny GEMM sweep


def model_config() -> ModelConfig:
    return ModelConfig.from_dict({"text_config": dict(PRESETS["qwen3.5-35b-a3b"]["text_config"])})


def bench_graph(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20)


def bench_eager(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50)


def copy_rate_gbs() -> float:
    """Device-to-device copy rate (read + write bytes per second) of a 1 GiB buffer, in GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench_eager(lambda: dst.copy_(src)) / 1e6


def gpu_activities(fn) -> int:
    """GPU kernels and copies of one eager call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def build_layer(kernels: str, cfg, tp: int, n_slots: int, gen: torch.Generator) -> dn.GatedDeltaNet:
    parallel._WORLD = tp  # rank 0's local shapes; one layer without its all-reduce needs no process group
    try:
        with backend.use_kernels(kernels):
            m = dn.GatedDeltaNet(cfg, dtype=torch.bfloat16, device="cuda")
    finally:
        parallel._WORLD = 1
    for name, p in m.named_parameters():  # in place: the projections are views of the fused weight
        if name == "A_log":
            p.data.copy_(torch.rand(p.shape, generator=gen, device="cuda") * 2.7)   # A in [1, 15], as released
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen, device="cuda") / math.sqrt(p.shape[-1]))
    m.conv_state = torch.randn(n_slots, m.conv_dim, m.kernel - 1, generator=gen, device="cuda").bfloat16()
    m.ssm_state = torch.randn(n_slots, m.num_v_heads, m.dk, m.dv, generator=gen, device="cuda") * 0.1
    return m


def make_batch(lens: list[int], starts: list[int], slots: list[int]) -> ForwardBatch:
    """What the DeltaNet layer reads of a runner's batch."""
    dev = "cuda"
    return ForwardBatch(
        input_ids=None, positions=None, slot_mapping=None,
        cu_seqlens=torch.tensor([0] + lens, device=dev).cumsum(0).int(),
        start_pos=torch.tensor(starts, dtype=torch.int32, device=dev), context_lens=None, block_tables=None,
        state_slots=torch.tensor(slots, device=dev), logits_indices=None, seq_lens_cpu=lens, start_pos_cpu=starts,
        state_slots_cpu=slots, is_decode=all(n == 1 and s > 0 for n, s in zip(lens, starts)))


def op_bytes(m: dn.GatedDeltaNet, batch: int) -> int:
    """Bytes the decode op must move: per sequence the fp32 state (read + write), the conv tail (read + write), its
    proj row and y; once the conv and norm weights and the gates' parameters. (The two-kernel op of 2026-11-23 also
    wrote the conv output and read it back, 4 * conv_dim bytes per sequence more, which this count leaves out.)"""
    state = m.num_v_heads * m.dk * m.dv * 4
    tail = m.conv_dim * (m.kernel - 1) * 2
    per_seq = 2 * state + 2 * tail + m.in_proj.shape[0] * 2 + m.num_v_heads * m.dv * 2
    return batch * per_seq + m.conv1d.weight.numel() * 2 + m.num_v_heads * 6 + m.dv * 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="local shapes of one rank at this TP degree")
    ap.add_argument("--sweep", action="store_true",
                    help="also time decode_fast's and linear_fast's launch settings per batch")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    cfg = model_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_slots = max(BATCHES) + 2
    layers = {k: build_layer(k, cfg, args.tp, n_slots, gen) for k in ("torch", "fast")}
    m = layers["fast"]
    n_layers = len(cfg.linear_attention_layers)
    weight_bytes = (m.in_proj.numel() + m.out_proj.weight.numel()) * 2
    copy = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}, TP={args.tp}: Hk={m.num_k_heads} Hv={m.num_v_heads} dk={m.dk} dv={m.dv} "
          f"conv {m.kernel}, conv_dim {m.conv_dim}, in_proj {tuple(m.in_proj.shape)}; {n_layers} DeltaNet layers; "
          f"copy rate {copy:.0f} GB/s; decode config {dn.DECODE_CONFIG}; skinny GEMM config {lin.SKINNY_CONFIG} "
          f"up to M = {lin.SKINNY_MAX_M}")
    print(f"{'op':<10}{'batch':>6}{'torch ms':>10}{'fast ms':>9}{'x':>6}{'GB/s':>7}{'% copy':>7}{'kernels':>9}"
          f"{'fast ms x layers':>18}")
    rows, sweeps = [], []
    projections = out_projections(cfg, args.tp)

    def row(op, batch, t_torch, t_fast, nbytes=None, kernels=None, per_step=n_layers):
        gbs = nbytes / t_fast / 1e6 if nbytes else None
        print(f"{op:<10}{batch:>6}{t_torch:>10.4f}{t_fast:>9.4f}{t_torch / t_fast:>6.1f}"
              f"{'-' if gbs is None else f'{gbs:.0f}':>7}{'-' if gbs is None else f'{100 * gbs / copy:.0f}':>7}"
              f"{kernels or '-':>9}{t_fast * per_step:>18.3f}")
        rows.append(dict(op=op, batch=batch, torch_ms=t_torch, fast_ms=t_fast, gb_s=gbs, kernels=kernels,
                         layers_ms=t_fast * per_step))

    with torch.inference_mode():
        for batch in BATCHES:
            slots = torch.randperm(n_slots - 1, generator=gen, device="cuda")[:batch]
            x = torch.randn(batch, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
            proj = torch.nn.functional.linear(x, m.in_proj)
            op_args = (proj, m.conv_state, m.ssm_state, slots, m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight,
                       m.norm.eps)
            row("decode_op", batch, bench_graph(lambda: dn.decode_torch(*op_args)),
                bench_graph(lambda: dn.decode_fast(*op_args)), op_bytes(m, batch))
            fb = make_batch([1] * batch, [CONTEXT] * batch, slots.tolist())
            steps = {k: (lambda layer=layer: layer(x, fb)) for k, layer in layers.items()}
            kernels = "/".join(str(gpu_activities(steps[k])) for k in ("torch", "fast"))
            row("layer", batch, bench_graph(steps["torch"]), bench_graph(steps["fast"]),
                op_bytes(m, batch) + weight_bytes, kernels)
            for name, (w, count) in projections.items():
                xp = torch.randn(batch, w.shape[1], generator=gen, device="cuda").bfloat16()
                row(name, batch, bench_graph(lambda: lin.linear_torch(xp, w)),
                    bench_graph(lambda: lin.linear_fast(xp, w)), linear_bytes(w, batch), per_step=count)
            row("mixed", batch, *mixed_times(layers, cfg, batch, gen))
            if args.sweep and batch in SWEEP_BATCHES:
                sweeps += sweep_decode(op_args, batch, op_bytes(m, batch), copy)
            if args.sweep and batch in SWEEP_ROWS:
                w = projections["out_proj"][0]
                sweeps += sweep_skinny(w, batch, gen, copy)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tp": args.tp, "copy_gb_s": copy,
                       "config": dn.DECODE_CONFIG, "skinny_config": lin.SKINNY_CONFIG, "rows": rows,
                       "sweep": sweeps}, f, indent=1)


def out_projections(cfg, tp: int) -> dict[str, tuple[torch.Tensor, int]]:
    """{name: (random bf16 weight of one rank's shard [hidden, K / tp], layers of that kind)}."""
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    od = cfg.num_attention_heads * cfg.head_dim
    n_attn = len(cfg.layer_types) - len(cfg.linear_attention_layers)
    return {name: (torch.randn(cfg.hidden_size, k // tp, device="cuda").bfloat16() * (k // tp) ** -0.5, count)
            for name, k, count in (("out_proj", vd, len(cfg.linear_attention_layers)), ("o_proj", od, n_attn))}


def linear_bytes(w: torch.Tensor, rows: int) -> int:
    return (w.numel() + rows * (w.shape[0] + w.shape[1])) * w.element_size()


def mixed_times(layers, cfg, batch: int, gen: torch.Generator) -> tuple[float, float]:
    """(mixed_torch ms, mixed_fast ms) of `batch` decode rows then one fresh prompt of PROMPT tokens, eager."""
    slots = torch.randperm(batch + 1, generator=gen, device="cuda").tolist()
    fb = make_batch([1] * batch + [PROMPT], [CONTEXT] * batch + [0], slots)
    x = torch.randn(batch + PROMPT, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
    times = []
    for layer, op in ((layers["torch"], "mixed_torch"), (layers["fast"], "mixed_fast")):
        proj = torch.nn.functional.linear(x, layer.in_proj)
        times.append(bench_eager(lambda layer=layer, op=op: getattr(layer, op)(proj, fb)))
    return times[0], times[1]


def sweep_decode(op_args, batch: int, nbytes: int, copy: float) -> list[dict]:
    """decode_fast per launch setting at this batch, best first (the default marked *)."""
    saved = dict(dn.DECODE_CONFIG)
    prefix = "batched_" if batch >= saved["batched_from"] else ""  # the keys this batch's launch reads
    results = []
    try:
        for block_v, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)):
            if block_v > 32 * warps:  # over 128 fp32 state elements per thread (at dk = 128): spills
                continue
            dn.DECODE_CONFIG.update({prefix + "block_v": block_v, prefix + "warps": warps})
            results.append((bench_graph(lambda: dn.decode_fast(*op_args)), {"block_v": block_v, "warps": warps}))
    finally:
        dn.DECODE_CONFIG.update(saved)
    default = {"block_v": saved[prefix + "block_v"], "warps": saved[prefix + "warps"]}
    return report_sweep("decode_fast", batch, results, default, nbytes, copy)


def sweep_skinny(w: torch.Tensor, rows: int, gen: torch.Generator, copy: float) -> list[dict]:
    """linear_fast per launch setting at M = rows on the out_proj shard, best first (the default marked *)."""
    x = torch.randn(rows, w.shape[1], generator=gen, device="cuda").bfloat16()
    saved = dict(lin.SKINNY_CONFIG)
    results = []
    try:
        for block_n, block_k, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (2, 3, 4)):
            lin.SKINNY_CONFIG.update(block_n=block_n, block_k=block_k, warps=warps, stages=stages)
            try:
                results.append((bench_graph(lambda: lin.linear_fast(x, w)), dict(lin.SKINNY_CONFIG)))
            except triton.runtime.errors.OutOfResources:  # the pipeline's tiles do not fit in shared memory
                continue
    finally:
        lin.SKINNY_CONFIG.update(saved)
    return report_sweep("linear_fast", rows, results, saved, linear_bytes(w, rows), copy)


def report_sweep(op: str, batch: int, results, default: dict, nbytes: int, copy: float) -> list[dict]:
    """Print the best four settings and the default; return every one as a row."""
    results.sort(key=lambda r: r[0])
    out = []
    for rank, (t, setting) in enumerate(results):
        gbs = nbytes / t / 1e6
        out.append(dict(op=op, batch=batch, ms=t, gb_s=gbs, pct_copy=100 * gbs / copy, config=setting))
        if rank < 4 or setting == default:
            print(f"  sweep {op} batch {batch}: {t:.4f} ms {gbs:6.0f} GB/s {100 * gbs / copy:4.0f}% copy "
                  f"{setting}{' *' if setting == default else ''}")
    return out


if __name__ == "__main__":
    main()
