"""`qwen35.bench --mode spec`: speculative decoding with the MTP head, measured in the engine (issue #28).

    torchrun --nproc-per-node N -m qwen35.bench --mode spec --load-format dummy-spec --spec-acceptance 0.6 \
        [--batch-sizes 1,8,32,64] [--spec-ks 0,1,2,3,auto] [--input-len 1024] [--output-len 64]

Per batch B and setting k (0: speculation off; K: K drafts every decode step; auto: the policy of
scheduler/speculation.py): B requests of --input-len random prompt tokens, sampled at temperature 1 (the temperature
the synthetic acceptance is made for), ignore_eos, --output-len tokens each, all added at once; the prefill steps
are not timed, then every step until all have finished is. Reported per row: wall ms per step (host included; the
engine overlaps the host's work with the device's as in serving: verify -> verify steps too), completion tokens per sequence per step, the
effective ms per emitted token (per sequence: wall / tokens each sequence emitted), the acceptance measured in that
run (accepted / drafted drafts that could count), and how many verify steps replayed a CUDA graph and how many ran
eagerly (the runner's counts: rank 0's). Nothing is assumed: the acceptance is what the drafts got.
The engine is built once with room for the most drafts asked for; each row sets the policy's k.

--spec-profile B:K[,B:K...] also runs those rows under torch.profiler (rank 0's kernels) and prints where a timed
step's GPU time goes: the top kernels by time per step, with their launches per step.
"""
from __future__ import annotations

import contextlib
import random
import time

from qwen35.bench.engine_runs import prompt_vocab, run_to_completion
from qwen35.engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from scheduler.speculation import parse_speculative_tokens


def parse_ks(text: str) -> list:
    return [parse_speculative_tokens(k.strip()) for k in text.split(",") if k.strip()]


def spec_run(engine: LLMEngine, batch: int, k, input_len: int, output_len: int, rng: random.Random,
             timed=contextlib.nullcontext) -> dict:
    """One row; `timed()` a context around the timed steps (a profiler)."""
    policy = engine.speculation
    policy.setting = k
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    vocab = prompt_vocab(engine)
    for i in range(batch):
        engine.add_request(f"spec-{batch}-{k}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    while any(not r.output_ids for r in engine.requests.values()):  # the prefill steps, untimed
        engine.step()
    before = sum(len(r.output_ids) for r in engine.requests.values())
    drafted, accepted, steps = policy.drafted, policy.accepted, engine.num_steps
    counts = dict(engine.runner.verify_counts)
    steps -= engine.step_in_flight  # (overlap: a step queued during the prefill loop runs in the window)
    with timed():
        t0 = time.perf_counter()
        run_to_completion(engine)
        wall = time.perf_counter() - t0
    steps = max(1, engine.num_steps - steps)
    per_seq = (batch * output_len - before) / batch  # tokens each sequence emitted in the timed steps
    drafted, accepted = policy.drafted - drafted, policy.accepted - accepted
    return {"batch": batch, "k": k, "steps": steps, "step_ms": round(1e3 * wall / steps, 4),
            "tokens_per_step": round(per_seq / steps, 4), "ms_per_token": round(1e3 * wall / max(per_seq, 1), 4),
            "drafted": drafted, "accepted": accepted,
            "verify_graph_steps": engine.runner.verify_counts["graph"] - counts["graph"],
            "verify_eager_steps": engine.runner.verify_counts["eager"] - counts["eager"],
            "acceptance": round(accepted / drafted, 4) if drafted else None}


def profile_row(engine: LLMEngine, batch: int, k, input_len: int, output_len: int, rng: random.Random,
                top: int = 30) -> dict:
    """One spec_run with torch.profiler around its timed steps: their kernels per step, top `top` by time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    row = spec_run(engine, batch, k, input_len, output_len, rng, timed=lambda: prof)
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
    """Every (batch, k) row, after one short warm-up run per k (first-use costs out of the table); the policy's
    setting is put back after."""
    policy = engine.speculation
    setting = policy.setting
    try:
        for k in ks:
            spec_run(engine, 1, k, 16, 8, rng)
        rows = []
        print(f"{'batch':>5} {'k':>5} {'step ms':>8} {'tok/step':>9} {'ms/token':>9} {'accept':>7} {'vs k=0':>7} {'graph/eager':>12}")
        for b in batches:
            base = None
            for k in ks:
                r = spec_run(engine, b, k, input_len, output_len, rng)
                if k == 0:
                    base = r["ms_per_token"]
                r["vs_off"] = round(r["ms_per_token"] / base, 4) if base else None
                rows.append(r)
                print(f"{b:5d} {str(k):>5} {r['step_ms']:8.3f} {r['tokens_per_step']:9.3f} {r['ms_per_token']:9.3f} "
                      f"{r['acceptance'] if r['acceptance'] is not None else '-':>7} "
                      f"{r['vs_off'] if r['vs_off'] is not None else '-':>7} "
                      f"{r['verify_graph_steps']:>6}/{r['verify_eager_steps']:<5}", flush=True)
        drafted = sum(r["drafted"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        return {"acceptance": round(accepted / drafted, 4) if drafted else None, "spec": rows}
    finally:
        policy.setting = setting
