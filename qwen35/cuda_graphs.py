"""CUDA graphs for pure-decode steps: one graph per padded batch size (with speculation also the verify steps':
VerifyGraphs, at the end). A decode step is ~3,000 small kernels for the 40-layer model; a replay launches them as
one. The host copies the step's rows (slot, position, token) into the
graphs' static rows in one transfer; the graph itself works out the rest (decode_batch: input ids, the slots' block
tables, KV slots, context lengths), which runner.prepare's ~20 eager ops and the copies into static inputs did
before (~0.3 ms of host time per step on an H200 host, 2026-11-26).

Padded rows (a batch of 5 runs the graph of 8) name the scratch state slot, whose block table holds only the scratch
KV block that the runner allocates one extra of, so they never touch a real request's state. The graph covers the
rows -> final norm (`run`). The engine's steps go on with a tail graph (`run_tail`): the LM head over the graph's
rows, sampling from this rank's vocabulary slice, and the tokens fed to the slots' next inputs and, on rank 0, into
one half of the runner's pinned host ring: one tail per graph size, sampling mode (TAIL_MODES: what a step's
sampling asks of the kernels is fixed by its hints) and ring half (a graph's host address is fixed). Queued
eagerly, that tail was ~25 launches, 0.5-0.6 ms of host time per step on an H200 host (2026-11-26); a replay is
one. Padded rows sample the scratch slot's settings and feed its token, which nothing reads. Steps whose sampling
no tail holds (top-k, top-p, suppressed ids) and `runner.execute` (logits for the caller) run the LM head eagerly
after the replay, on the real rows only.

The host may queue step N+1 while step N still runs (the engine's overlap): N+1's copy into the static rows is
queued on the same stream behind N's replays, so it never overwrites rows that N has yet to read (and the pinned
memory it copies from comes from torch's caching host allocator, which hands it out again only once the copy ran).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from dist import parallel
from layers.forward_batch import ForwardBatch
from layers.sampler import SamplingStep
from qwen35.mtp import write_kv

log = logging.getLogger("qwen35.graphs")


def pad_row(runner) -> tuple[int, int, int]:
    """A padded row of a decode graph: (slot, position, token) = the scratch slot at position 0, fed the token last
    sampled for it. Its block table (runner: every entry the scratch KV block) and state are scratch only."""
    return runner.scratch_slot, 0, -1


def decode_batch(runner, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None,
                 tables: torch.Tensor | None = None, **host) -> ForwardBatch:
    """A pure-decode batch's inputs, as device ops only (so that a CUDA graph holds them): runner.prepare's eager
    step and the decode graphs both build theirs here. The rows: slot, position (tokens already cached) and token
    ([b] int64 device tensors; a token -1, or tokens None for every row: the one sampled for the slot, on the
    device). `tables`: the rows' block tables (default: the slots' whole rows). `host`: the ForwardBatch fields the
    caller knows besides (the eager step's host lists and logits rows); a graph knows none when it is captured, and
    the decode ops read none."""
    b, bs = slots.shape[0], runner.block_size
    if tables is None:
        tables = runner.block_table[slots]
    blocks = tables.gather(1, (positions // bs)[:, None])[:, 0]
    fed = runner.slot_tokens[slots]
    fields = dict(
        input_ids=fed if tokens is None else torch.where(tokens < 0, fed, tokens), positions=positions,
        slot_mapping=blocks.long() * bs + positions % bs, cu_seqlens=None, start_pos=None,
        context_lens=(positions + 1).to(torch.int32), block_tables=tables, state_slots=slots, logits_indices=None,
        seq_lens_cpu=[1] * b, start_pos_cpu=[1] * b, state_slots_cpu=[runner.scratch_slot] * b, is_decode=True)
    fields.update(host)
    return ForwardBatch(**fields)


@contextlib.contextmanager
def collector_paused():
    """Around a set of captures: one full collection, then Python's cyclic collector off until the set is captured.
    A collection that runs mid-capture may free a dead engine's CUDA graphs, and destroying a graph's executable
    synchronizes, which invalidates the capture under way (the next launch in it fails with "operation failed due to
    a previous error during capture"). torch.cuda.graph no longer collects on entry (torch.compiler.config
    .force_cudagraph_gc), and runners live in reference cycles, so their graphs die only in a collection."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


TAIL_MODES = ("greedy", "sampled")
RING_HALVES = 2  # the host ring's halves (runner.host_ring): step k's tokens land in half k % 2


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
    """The decode graphs' batch sizes: every size up to 32, every 4th up to 64, every 8th beyond, and max_num_seqs.
    A step runs the smallest graph that holds its rows, and a padded row costs much of what a real one does, so every
    step of a batch between two sizes paid for the gap. Against 1, 2, 4, 8 and every 8th from 16 (one 2x H200 call,
    TP=2, 2026-11-28): 3.01 / 3.71 / 5.29 / 6.92 -> 2.73 / 3.50 / 4.92 / 6.74 ms a step at batch 3 / 5 / 12 / 20,
    HTTP 227,829 -> 231,599 (`results/2026-11-28_*_graph_sizes_*.json`); 48 graphs (to 128 rows) capture in 3.4 s
    instead of 2.7."""
    return _up_to(max_num_seqs, list(range(1, 33)) + list(range(36, 65, 4)) + list(range(72, max_num_seqs + 1, 8)))


def verify_sizes(max_num_seqs: int) -> list[int]:
    """The verify graphs' batch sizes: coarser than the decode graphs' (a verify graph is captured per size, k and
    mode): 1, 2, 4, 8, every 8th from 16, and max_num_seqs."""
    return _up_to(max_num_seqs, [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8)))


def _up_to(max_num_seqs: int, sizes: list[int]) -> list[int]:
    """`sizes` that a batch of max_num_seqs rows can use, and max_num_seqs itself (the largest graph), sorted."""
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        # the rows of the step, [3, max_num_seqs] (decode_batch): written by one copy per step, padded rows included
        self.rows = self._padded_rows().to(runner.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # size -> the batch its graph built from the rows (positions, KV slots: static, valid after each replay)
        self.batches: dict[int, ForwardBatch] = {}
        # (size, mode, ring half) -> (graph, its tokens [size]); captured once the engine's sampler exists
        self.tails: dict[tuple[int, str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.size = 0  # the graph size run() picked last
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    @collector_paused()
    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.time()
        runner, model = self.runner, self.runner.model
        for b in sorted(capture_sizes(runner.max_num_seqs), reverse=True):  # largest first: pool reuse
            model(decode_batch(runner, *self.rows[:, :b]))  # warm-up outside the graph (lazy inits, NCCL, compiles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                batch = decode_batch(runner, *self.rows[:, :b])
                out = model(batch)
            self.graphs[b], self.batches[b] = (graph, out), batch
        self._size_for = [min(s for s in self.graphs if s >= n) for n in range(max(self.graphs) + 1)]
        torch.cuda.synchronize()
        parallel.barrier()
        if parallel.is_driver():
            log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs),
                     sorted(self.graphs), time.time() - t0)

    def _padded_rows(self) -> torch.Tensor:
        return torch.tensor([pad_row(self.runner)] * self.runner.max_num_seqs, dtype=torch.int64).T.contiguous()

    @property
    def max_size(self) -> int:
        return max(self.graphs)

    def run(self, slots: list[int], positions: list[int], tokens: list[int] | None) -> torch.Tensor:
        """Final-norm hidden states [n, H] of n decode rows (slot, position, token: None = every row fed the token
        sampled for its slot), by one copy of the rows and a replay of the smallest graph that holds them. The
        caller has checked the rows (runner: slots in range, positions inside their block tables)."""
        n = len(slots)
        b = self._size_for[n]
        slot, pos, tok = pad_row(self.runner)
        pad = b - n
        host = torch.tensor([*slots, *[slot] * pad, *positions, *[pos] * pad,
                             *(tokens if tokens is not None else [tok] * n), *[tok] * pad],
                            dtype=torch.int64, pin_memory=self.runner._pin)
        self.rows[:, :b].copy_(host.view(3, b), non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        self.size = b
        return out[:n]

    @collector_paused()
    @torch.inference_mode()
    def capture_tails(self, sample, feed, ring: list[torch.Tensor] | None) -> None:
        """A tail graph per graph size, mode and ring half: sample(logits, slots, step) -> tokens and feed(tokens,
        slots, slot_tokens, host) are the engine's sampler and the runner's feed, then, with an MTP head, the head's
        KV at the rows' positions (write_head_kv); ring the host's halves (rank 0) or None. Every rank captures a
        tail per half (one way on every rank, keyed the same; where no ring is given, both halves' tails feed the
        device only)."""
        t0 = time.time()
        runner = self.runner
        self.rows.copy_(self._padded_rows())  # the warm-ups sample and feed the scratch slot only
        halves = range(RING_HALVES)
        for b in sorted(self.graphs, reverse=True):
            hidden, slots = self.graphs[b][1], self.rows[0, :b]
            for mode in TAIL_MODES:
                step = SamplingStep(greedy_only=mode == "greedy")

                def tail(half):
                    logits = runner.model.compute_logits(hidden, gather="none")
                    tokens = sample(logits, slots, step)
                    feed(tokens, slots, runner.slot_tokens, ring[half][:b] if ring else None)
                    if runner.model.mtp is not None:
                        self.write_head_kv(b, b, hidden, tokens)
                    return tokens

                tail(0)  # warm-up outside the graph (lazy inits, compiles): on the scratch slot's state
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

    def write_head_kv(self, size: int, n: int, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """The MTP head's KV at the positions of the first n rows of the graph of `size` rows, just replayed (a
        decode step's, one a sequence: hidden [n, H] its post-norm hidden, tokens [n] what it sampled), as
        qwen35/mtp.py write_kv: in the sampling tails, and after a replay whose sampling no tail holds. The positions
        and KV slots are the ones that graph computed (its captured batch), not worked out again."""
        batch = self.batches[size]
        write_kv(self.runner.model, batch.positions[:n], batch.slot_mapping[:n], hidden, tokens)

    def run_tail(self, n: int, mode: str, half: int | None) -> torch.Tensor:
        """After run() of an n-row batch: its tail for `mode` and ring `half` (None: a rank without a ring, whose
        tails of either half are the same); the real rows' tokens."""
        graph, tokens = self.tails[self.size, mode, half or 0]
        graph.replay()
        return tokens[:n]


class VerifyGraphs:
    """CUDA graphs for speculative decoding's pure-decode verify steps (runner.verify_step): one graph per (padded
    batch size, spec_k, k, sampling mode), spec_k k or 0: the steady state, where a verify step of k drafts per row
    proposes k drafts for the next (plan.draft_k == plan.spec_k), and the step that starts it, where rows fed from
    the device verify nothing and propose k (spec_k 0: one token a row, as a plain step; after a step that did not
    propose, e.g. a request's admission or auto's k back from 0, which otherwise ran eagerly, ~10x a replay). A
    replay is the whole step the runner queues eagerly: the inputs
    from the slots' device buffers (runner.verify_inputs: static shapes, whole block tables, no host list), the
    forward of b * (spec_k + 1) rows, the logits at every position, acceptance (greedy, or rejection sampling without
    top-k / top-p: tail_mode), the DeltaNet commit, the slots' next tokens and draw counters, and the proposal of
    the next k drafts into the slots' draft buffers; its output is the emitted tokens [b, spec_k + 1] (-1 after
    them), which reach the host through the runner's pinned ring (runner.sample_step).

    The host copies the rows (slot, start position, behind: runner.verify_starts) into the static rows in one
    transfer. Padded rows name the
    scratch slot at position 0: its block table holds only the scratch KV block, its drafts the draft buffers' last
    row (runner.draft_rows), its sampling settings are greedy and its slot_end 0 (no draft may be accepted), so a
    padded row reads and writes scratch state only. Verify steps the graphs do not hold (another draft_k, top-k /
    top-p, suppressed ids, more rows than the largest size) run eagerly. `capture=False` keeps the rows and runs the
    graphs' work eagerly instead (the CPU tests of the static-shape step)."""

    def __init__(self, runner, pool=None, capture: bool = True):
        self.runner = runner
        self.rows = self._padded_rows().to(runner.device)  # [3, max_num_seqs]: slot, start position, behind
        self.sizes = verify_sizes(runner.max_num_seqs)
        self._size_for = [min(s for s in self.sizes if s >= n) for n in range(self.sizes[-1] + 1)]
        self.max_k = runner.spec_max_k
        self.graphs: dict[tuple[int, int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captured = capture
        # the buffers sampled steps read the drafts' logits from, made before any is captured or run (a step that
        # only proposes may come before the first proposal has made them)
        runner.draft_buffers(runner.model.lm_head.weight.shape[0])
        if capture:
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self._capture_all()

    def _padded_rows(self) -> torch.Tensor:
        n = self.runner.max_num_seqs
        return torch.tensor([[self.runner.scratch_slot] * n, [0] * n, [0] * n], dtype=torch.int64)

    def holds(self, plan, sampling: SamplingStep) -> bool:
        """Whether a verify step (the runner has checked it: decode rows from the device, no checkpoint) replays a
        graph: it proposes 1..max_k drafts and verifies as many or none, its rows fit the largest size, its sampling
        a mode."""
        return (0 < plan.draft_k <= self.max_k and plan.spec_k in (0, plan.draft_k)
                and 0 < plan.num_seqs <= self.sizes[-1] and tail_mode(sampling) is not None)

    def _step(self, b: int, spec_k: int, k: int, mode: str, host: dict) -> torch.Tensor:
        runner = self.runner
        batch, num_drafts = runner.verify_inputs(self.rows[0, :b], self.rows[1, :b], self.rows[2, :b], spec_k + 1,
                                                 **host)
        return runner.verify_forward(batch, num_drafts, SamplingStep(greedy_only=mode == "greedy"), k)

    @collector_paused()
    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.time()
        runner = self.runner
        padded = self._padded_rows().to(runner.device)
        for b in sorted(self.sizes, reverse=True):  # largest first: pool reuse
            for k in range(1, self.max_k + 1):
                for spec_k in (k, 0):
                    for mode in TAIL_MODES:
                        self.rows.copy_(padded)
                        self._step(b, spec_k, k, mode, {})  # warm-up outside the graph (lazy inits, compiles)
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            tokens = self._step(b, spec_k, k, mode, {})
                        self.graphs[b, spec_k, k, mode] = (graph, tokens)
        torch.cuda.synchronize()
        parallel.barrier()
        if parallel.is_driver():
            log.info("captured %d verify CUDA graphs (batch sizes %s, k 1..%d verified or none, %s) in %.1f s",
                     len(self.graphs), self.sizes, self.max_k, "/".join(TAIL_MODES), time.time() - t0)

    def run(self, slots: list[int], starts: list[int], behind: int, spec_k: int, k: int, mode: str) -> torch.Tensor:
        """The emitted tokens [n, spec_k + 1] of a verify step of n rows (slot, start: the newest token's position,
        as the host knows it when `behind`) that proposes k drafts, by one copy of the rows and a replay of the
        smallest graph that holds them (a view of the graph's output: read it before the next replay). The caller
        has set and checked the rows' block tables."""
        n = len(slots)
        b = self._size_for[n]
        pad = b - n
        slot = self.runner.scratch_slot
        host = torch.tensor([*slots, *[slot] * pad, *starts, *[0] * pad, *[behind] * n, *[0] * pad],
                            dtype=torch.int64, pin_memory=self.runner._pin)
        self.rows[:, :b].copy_(host.view(3, b), non_blocking=True)
        if self.captured:
            graph, tokens = self.graphs[b, spec_k, k, mode]
            graph.replay()
        else:  # the same work, queued eagerly, with the host lists the torch kernels read
            tokens = self._step(b, spec_k, k, mode, dict(start_pos_cpu=[*starts, *[0] * pad],
                                                         state_slots_cpu=[*slots, *[slot] * pad]))
        return tokens[:n]
