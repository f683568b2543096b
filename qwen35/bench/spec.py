"""`qwen35.bench --mode spec`: speculative decoding with the MTP head, measured in the engine (issue #28).

    torchrun --nproc-per-node N -m qwen35.bench --mode spec --load-format dummy-spec --spec-acceptance 0.6 \
        [--batch-sizes 1,8,32,64] [--spec-ks 0,1,2,3,auto] [--input-len 1024] [--output-len 64]

Per batch B and setting k (0: speculation off; K: K drafts every decode step; auto: the policy of
scheduler/speculation.py), a row of qwen35/spec_costs.py measure_row: B requests of --input-len random prompt
tokens, sampled at temperature 1 (the temperature the synthetic acceptance is made for), --output-len tokens each;
wall ms per step (host included, overlapped as in serving), tokens per sequence per step, ms per emitted token, the
acceptance measured (nothing is assumed: the acceptance is what the drafts got), verify steps replayed and eager
(rank 0's counts); then the steps while all B requests ran (what the cost table takes), their ms per step, tokens
per sequence per step and ms per token against k = 0's. The engine is built once with room for the most drafts asked
for; each row sets the policy's k. The rows make the cost table `auto` chooses by (scheduler/spec_costs.json ships
them; a server measures its own at start where none ships: qwen35/spec_costs.py measure_table).

--spec-profile B:K[,B:K...] also runs those rows under torch.profiler (rank 0's kernels) and prints where a timed
step's GPU time goes: the top kernels by time per step, with their launches per step.
"""
from __future__ import annotations

import random

from qwen35.engine import LLMEngine
from qwen35.spec_costs import measure_row, measure_rows
from scheduler.speculation import parse_speculative_tokens


def parse_ks(text: str) -> list:
    return [parse_speculative_tokens(k.strip()) for k in text.split(",") if k.strip()]


def profile_row(engine: LLMEngine, batch: int, k, input_len: int, output_len: int, rng: random.Random,
                top: int = 30) -> dict:
    """One measure_row with torch.profiler around its timed steps: their kernels per step, top `top` by time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    row = measure_row(engine, batch, k, input_len, output_len, rng, timed=lambda: prof)
    per = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            per[e.key] = (e.device_time_total, e.count)
    steps = max(1, row["steps"])
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    total = sum(t for t, _ in per.values())
    print(f"--- profile batch {batch} k {k}: {steps} timed steps, {row['step_ms']:.3f} ms a step; GPU time "
          f"{total / 1e3 / steps:.3f} ms a step, top {top} kernels:")
    for name, (t, n) in rows:
        print(f"{t / steps:9.1f} us/step {n / steps:7.1f} launches/step  {name[:100]}")
    return {"batch": batch, "k": k, "steps": steps, "step_ms": row["step_ms"],
            "kernels": [{"name": name[:200], "us_per_step": round(t / steps, 2), "launches_per_step":
                         round(n / steps, 2)} for name, (t, n) in rows]}


def spec_rows(engine: LLMEngine, batches: list[int], ks: list, input_len: int, output_len: int,
              rng: random.Random) -> dict:
    """Every (batch, k) row (qwen35/spec_costs.py measure_rows), each printed with its ms per token against the
    batch's k = 0 row."""
    base, full_base = {}, {}

    def show(r: dict) -> None:
        if r["k"] == 0:
            base[r["batch"]] = r["ms_per_token"]
        off = base.get(r["batch"])
        r["vs_off"] = round(r["ms_per_token"] / off, 4) if off else None
        full = r["full_step_ms"] / r["full_tokens_per_step"]
        if r["k"] == 0:
            full_base[r["batch"]] = full
        full_vs = f"{full / full_base[r['batch']]:.4f}" if r["batch"] in full_base else "-"
        print(f"{r['batch']:5d} {str(r['k']):>5} {r['step_ms']:8.3f} {r['tokens_per_step']:9.3f} "
              f"{r['ms_per_token']:9.3f} {r['acceptance'] if r['acceptance'] is not None else '-':>7} "
              f"{r['vs_off'] if r['vs_off'] is not None else '-':>7} "
              f"{r['verify_graph_steps']:>6}/{r['verify_eager_steps']:<5} {r['full_steps']:>5} "
              f"{r['full_step_ms']:8.3f} {r['full_tokens_per_step']:9.3f} {full_vs:>7}", flush=True)

    print(f"{'batch':>5} {'k':>5} {'step ms':>8} {'tok/step':>9} {'ms/token':>9} {'accept':>7} {'vs k=0':>7} "
          f"{'graph/eager':>12} | all rows running: {'steps':>5} {'step ms':>8} {'tok/step':>9} {'vs k=0':>7}")
    rows = measure_rows(engine, batches, ks, input_len, output_len, rng, show)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    return {"acceptance": round(accepted / drafted, 4) if drafted else None, "spec": rows}
