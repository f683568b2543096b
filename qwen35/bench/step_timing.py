"""Runner-level timings of record for `qwen35.bench`: decode steps and prefill, measured the same way every time.

decode rows (one per batch size, every sequence at context `ctx`):
  kernels_per_step  CUDA kernels launched by one eager forward + LM head (torch.profiler; memcpy/memset not counted;
                    counted after everything else is timed: decode_kernels)
  step_ms           one step as the engine runs it (CUDA graph where captured), CUDA events, mean over many steps
  floor_ms          bytes the step must move / the copy rate measured in the same run (see decode_bytes)
prefill rows: `seqs` fresh prompts of `len` tokens, run in steps of at most `max_tokens` tokens, wall time on the GPU.

The caches hold whatever they hold: timings do not depend on the values (attention reads context_len keys, the
recurrent state is read and written whole), so no prompt is prefilled before a decode row.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qwen35.cuda_graphs import collector_paused
from scheduler.plan import StepPlan


def copy_rate(device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device copy rate in bytes/s, read + write counted (the convention of the floor in issue #8)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    rate = reps * nbytes / (start.elapsed_time(end) / 1e3)
    del src, dst
    return rate


def decode_bytes(runner, batch: int, ctx: int) -> int:
    """Bytes one decode step must move on this rank: every weight except the experts and the embedding table,
    the experts a batch of `batch` tokens is expected to hit under uniform routing (E * (1 - (1 - k/E)^batch) per
    layer), one embedding row per token, the KV cache read (ctx tokens) and the DeltaNet state read and written."""
    model, cfg = runner.model, runner.config
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            local = p.shape[0]
            hit = local * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
            total += int(nbytes * min(local, hit) / local)
        elif name.startswith("embed_tokens"):
            total += batch * p.shape[1] * p.element_size()
        else:
            total += nbytes
    for m in runner.attn_layers:
        total += batch * ctx * 2 * m.num_kv_heads * m.head_dim * m.k_cache.element_size()
    for m in runner.gdn_layers:
        per_seq = m.ssm_state[0].numel() * 4 + m.conv_state[0].numel() * m.conv_state.element_size()
        total += 2 * batch * per_seq
    return total


def decode_plan(runner, batch: int, ctx: int) -> StepPlan:
    """`batch` sequences at context ctx - 1, each feeding one token (block tables disjoint, slots 0..batch-1).

    The tokens differ (seeded), so that the rows route to different experts as real requests do: identical rows
    would all hit the same top-k experts and make a large batch look cheaper than it is."""
    nblk = math.ceil(ctx / runner.block_size)
    if batch * nblk > runner.num_kv_blocks or batch > runner.num_state_slots:
        raise ValueError(f"batch {batch} at context {ctx} does not fit the caches")
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, runner.config.vocab_size - 300, (batch, 1), generator=gen).tolist()
    return StepPlan(state_slots=list(range(batch)), token_ids=tokens, start_pos=[ctx - 1] * batch,
                    block_tables=[list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)],
                    want_logits=[True] * batch)


def count_kernels(fn) -> int:
    """CUDA kernels one call of fn launches (eager)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def time_cuda(fn, steps: int) -> float:
    """Mean ms per call over `steps` back-to-back calls, CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def graph_ms(body, replays: int = 10) -> float:
    """Mean ms per replay of one CUDA graph of body() (captured once, replayed once before timing)."""
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        body()
    graph.replay()
    return time_cuda(graph.replay, replays)


def _decode_plan_set(runner, batch: int, ctx: int) -> StepPlan:
    """decode_plan after one run of it (warm-up: graph pick, lazy inits; the slots' block tables set), then without
    its block tables (kept, as in an engine decode step)."""
    plan = decode_plan(runner, batch, ctx)
    runner.execute(plan)
    return dataclasses.replace(plan, block_tables=[[] for _ in range(batch)])


def decode_row(runner, batch: int, ctx: int, rate: float, steps: int = 50) -> dict:
    """Step time (CUDA graph where there is one) and the memory floor of a decode step at `batch`, context `ctx`."""
    plan = _decode_plan_set(runner, batch, ctx)
    step_ms = time_cuda(lambda: runner.execute(plan), steps)
    nbytes = decode_bytes(runner, batch, ctx)
    return {"batch": batch, "ctx": ctx, "step_ms": round(step_ms, 4), "floor_ms": round(1e3 * nbytes / rate, 4),
            "bytes": nbytes, "graph": runner.graphs is not None}


def decode_kernels(runner, batch: int, ctx: int) -> int:
    """CUDA kernels of one eager decode step at `batch` (torch.profiler). The profiler leaves this process's CUDA
    calls slower after it (on an H200 host, 2026-11-26: queueing a graph-replayed engine step 0.11 -> 0.41 ms at
    batch 64, host time per step 0.08 -> 0.13-0.16 ms), so callers count kernels after everything they time."""
    plan = _decode_plan_set(runner, batch, ctx)
    return count_kernels(lambda: runner.execute(plan, eager=True))


def prefill_row(runner, seqs: int, length: int, max_tokens: int, reps: int = 2) -> dict:
    """Fresh prompts of `length` random tokens on slots 0..seqs-1, packed into steps of at most max_tokens."""
    nblk = math.ceil(length / runner.block_size)
    gen = torch.Generator().manual_seed(seqs)
    ids = torch.randint(0, runner.config.vocab_size - 300, (seqs, length), generator=gen).tolist()
    per_step = max(1, max_tokens // length)
    plans = []
    for s0 in range(0, seqs, per_step):
        chunk = range(s0, min(seqs, s0 + per_step))
        plans.append(StepPlan(state_slots=list(chunk), token_ids=[ids[i] for i in chunk], start_pos=[0] * len(chunk),
                              block_tables=[list(range(i * nblk, (i + 1) * nblk)) for i in chunk],
                              want_logits=[True] * len(chunk)))
    for p in plans[:1]:
        runner.execute(p)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        for p in plans:
            runner.execute(p)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / reps
    return {"seqs": seqs, "len": length, "ms": round(ms, 2), "tok_s": round(seqs * length / (ms / 1e3), 1)}
