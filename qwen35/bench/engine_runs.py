"""Requests through LLMEngine, timed: run to completion, a static batch, decode steps profiled by the engine's
step timer (step_timer.py)."""
from __future__ import annotations

import random
import time

from qwen35.bench.step_timer import StepTimer
from qwen35.engine import LLMEngine
from qwen35.spec_costs import prompt_vocab
from scheduler.sampling_params import SamplingParams


def run_to_completion(engine: LLMEngine) -> dict[str, dict]:
    """Step until every request finished; per request: first-token time and finish time (perf_counter)."""
    seen: dict[str, dict] = {}
    get = seen.get
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rec = get(o.request_id)
            if rec is None:  # (setdefault would build a dict per output)
                rec = seen[o.request_id] = {"first": now, "tokens": 0}
            rec["tokens"] = o.num_completion_tokens
            if o.finished:
                rec["done"] = now
    return seen


def static_batch(engine: LLMEngine, batch: int, input_len: int, output_len: int, rng: random.Random) -> dict:
    vocab = prompt_vocab(engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"static-{batch}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    t0 = time.perf_counter()
    seen = run_to_completion(engine)
    end = max(r["done"] for r in seen.values())
    first = max(r["first"] for r in seen.values())  # every prompt prefilled and its first token out
    decode_s = end - first
    return {
        "batch": batch, "input_len": input_len, "output_len": output_len, "latency_s": end - t0,
        "input_tok_s": batch * input_len / (first - t0),
        "output_tok_s": batch * (output_len - 1) / decode_s if decode_s > 0 else 0.0,
        "itl_ms": 1e3 * decode_s / max(1, output_len - 1),
    }


def profile_steps(engine: LLMEngine, batch: int, input_len: int, decode_steps: int, rng: random.Random,
                  stream: bool = True) -> dict:
    """Mean per decode step at `batch`, as a StepTimer installed for the decode steps measures them: wall time per
    step, host time outside the forward (cpu_ms: scheduling, the plan broadcast, sampling, postprocess; with overlap
    it runs while the device computes), time queueing the forward, time the host waited for the device's tokens,
    and on a GPU the time the device sat idle between steps (gpu_idle_ms: the host time the overlap did not hide)."""
    vocab = prompt_vocab(engine)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{batch}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params, stream)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill first, untimed
        engine.step()
    engine.timer = t = StepTimer(engine)
    try:
        t0 = time.perf_counter()
        run_to_completion(engine)
        wall = time.perf_counter() - t0
    finally:
        engine.timer = None
    n = max(1, t.steps)
    return {"batch": batch, "steps": t.steps, "overlap": engine.overlap, "step_ms": 1e3 * wall / n,
            "cpu_ms": 1e3 * t.host_s / n, "forward_queue_ms": 1e3 * t.forward_s / n, "wait_ms": 1e3 * t.wait_s / n,
            "gpu_idle_ms": 1e3 * t.gpu_idle_s / t.gpu_gaps if t.gpu_gaps else float("nan")}
