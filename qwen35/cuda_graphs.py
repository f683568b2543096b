"""CUDA graphs for pure-decode steps: one graph per padded batch size, replayed with the step's values copied into
static input tensors. A decode step is ~3,000 small kernels for the 40-layer model; a replay launches them as one.

Padded rows (a batch of 5 runs the graph of 8) point at the scratch state slot and the scratch KV block that the
runner allocates one extra of, so they never touch a real request's state. The graph covers embedding -> final
norm (`run`). The engine's steps go on with a tail graph (`run_tail`): the LM head over the graph's rows, sampling
from this rank's vocabulary slice, and the tokens fed to the slots' next inputs and, on rank 0, into one half of
the runner's pinned host ring: one tail per graph size, sampling mode (TAIL_MODES: what a step's sampling asks of
the kernels is fixed by its hints) and ring half (a graph's host address is fixed). Queued eagerly, that tail was
~25 launches, 0.5-0.6 ms of host time per step on an H200 host (2026-11-26); a replay is one. Padded rows sample
the scratch slot's settings and feed its token, which nothing reads. Steps whose sampling a tail does not hold
(top-k, top-p, suppressed ids) and `runner.execute` (logits for the caller) run the LM head eagerly after the replay,
on the real rows only.

The host may queue step N+1 while step N still runs (the engine's overlap): N+1's copies into the static buffers
are queued on the same stream behind N's replay, so they never overwrite inputs that N has yet to read.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from dist import parallel
from layers.forward_batch import ForwardBatch
from layers.sampler import SamplingStep

log = logging.getLogger("qwen35.graphs")


def pad_values(runner) -> dict[str, int]:
    """What a padded row of a decode batch holds, per input: token 0 at position 0, reading and writing only the
    scratch KV block and the scratch state slot."""
    return {"input_ids": 0, "positions": 0, "slot_mapping": runner.num_kv_blocks * runner.block_size,
            "block_tables": runner.num_kv_blocks, "context_lens": 1, "state_slots": runner.scratch_slot}


TAIL_MODES = ("greedy", "sampled")


def tail_mode(step: SamplingStep) -> str | None:
    """The tail graph mode a step's sampling fits: every row greedy, or sampled rows with neither top-k nor top-p
    and no suppressed ids (the filters' rounds and the suppressed pairs depend on what the host sends); else None
    (eager)."""
    if step.suppress:
        return None
    if step.greedy_only:
        return "greedy"
    return None if step.any_top_k or step.any_top_p else "sampled"


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        dev, maxb = runner.device, runner.max_num_seqs
        width = math.ceil(runner.max_model_len / runner.block_size)
        self.pad = pad_values(runner)
        i64 = dict(dtype=torch.int64, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(maxb, **i64)
        self.positions = torch.zeros(maxb, **i64)
        self.slot_mapping = torch.zeros(maxb, **i64)
        self.block_tables = torch.zeros(maxb, width, **i32)
        self.context_lens = torch.ones(maxb, **i32)
        self.state_slots = torch.zeros(maxb, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # (size, mode, ring half or None) -> (graph, its tokens [size]); captured once the engine's sampler exists
        self.tails: dict[tuple[int, str, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.size = 0  # the graph size run() picked last
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            cu_seqlens=None, start_pos=None, context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
            state_slots=self.state_slots[:b], logits_indices=None, seq_lens_cpu=[1] * b, start_pos_cpu=[1] * b,
            state_slots_cpu=[self.pad["state_slots"]] * b, is_decode=True)

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) read and write only scratch state."""
        for name, value in self.pad.items():
            getattr(self, name)[start:end] = value

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.time()
        model = self.runner.model
        self._pad(0, self.runner.max_num_seqs)
        for b in sorted(capture_sizes(self.runner.max_num_seqs), reverse=True):  # largest first: pool reuse
            batch = self._batch(b)
            model(batch)  # warm-up outside the graph (lazy inits, NCCL communicators, Triton compiles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(batch)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        parallel.barrier()
        if parallel.is_driver():
            log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                     sorted(self.graphs), time.time() - t0)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.num_seqs <= max(self.graphs) \
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-norm hidden states [B, H] of the batch's B decode tokens, by graph replay."""
        n = batch.num_seqs
        b = min(s for s in self.graphs if s >= n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.context_lens[:n].copy_(batch.context_lens)
        self.state_slots[:n].copy_(batch.state_slots)
        if b > n:
            self._pad(n, b)
        graph, out = self.graphs[b]
        graph.replay()
        self.size = b
        return out[:n]

    @torch.inference_mode()
    def capture_tails(self, sample, feed, ring: list[torch.Tensor] | None) -> None:
        """A tail graph per graph size, mode and ring half: sample(logits, slots, step) -> tokens and feed(tokens,
        slots, slot_tokens, host) are the engine's sampler and the runner's feed; ring the host's halves (rank 0)
        or None. Every rank captures the same tails (sampling is collective at TP > 1)."""
        t0 = time.time()
        runner = self.runner
        self._pad(0, runner.max_num_seqs)  # the warm-ups sample and feed the scratch slot only
        halves = list(range(len(ring))) if ring else [None]
        for b in sorted(self.graphs, reverse=True):
            hidden, slots = self.graphs[b][1], self.state_slots[:b]
            for mode in TAIL_MODES:
                step = SamplingStep(greedy_only=mode == "greedy")

                def tail(half):
                    logits = runner.model.compute_logits(hidden, gather="none")
                    tokens = sample(logits, slots, step)
                    feed(tokens, slots, runner.slot_tokens, None if half is None else ring[half][:b])
                    return tokens

                tail(halves[0])  # warm-up outside the graph (lazy inits, compiles): on the scratch slot's state
                torch.cuda.synchronize()
                for half in halves:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        tokens = tail(half)
                    self.tails[b, mode, half] = (graph, tokens)
        torch.cuda.synchronize()
        parallel.barrier()
        if parallel.is_driver():
            log.info("captured %d sampling tail graphs in %.1f s", len(self.tails), time.time() - t0)

    def run_tail(self, n: int, mode: str, half: int | None) -> torch.Tensor:
        """After run() of an n-row batch: its tail for `mode` (and rank 0's ring `half`); the real rows' tokens."""
        graph, tokens = self.tails[self.size, mode, half]
        graph.replay()
        return tokens[:n]
