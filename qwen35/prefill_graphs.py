"""CUDA graphs for prefill steps of dense models (issue #29: the logits-level runtime's prefill calls).

Eager, a prefill step is ~10 launches a layer, each ~40-110 us of host time (Triton's launcher, cuBLAS's, torch's
small ops): a call of one 512-token prompt to Llama-1B took 8.8 ms (20 ms on a slower host) for 2.4 ms of kernels,
2.7 ms with the graphs (1x H200, 2026-11-29, benchmarks/profile_prefill_calls.py). A replay launches them as one.

One graph per bucket of packed tokens (prefill_buckets: 256 .. max tokens, each at most 1.5x the last, none past
what S padding sequences can hold) over a fixed S = max_num_seqs + 1 sequences, so the grids (which go by shapes:
layers/varlen.py) are fixed. A step's rows are padded (padded_rows): its T tokens, then the bucket's n - T as
padding sequences of the scratch slot at position 0 (whose block table holds only the scratch KV block: runner),
then empty sequences. Each sequence's tokens only
ever meet its own (row-wise projections and norms, attention within the sequence), so the real rows compute what
the eager step computes, up to the order of fp32 sums that cuBLAS picks for the padded row count. The graph covers
the rows -> final norm; the caller takes the hidden states of the rows that want logits (a gather after replay).

Dense models at TP=1 only: the DeltaNet's prefill reads the step's host lists (chunks per sequence), which a graph
fixes at capture, and under TP the boundaries of a prefill step are NCCL's.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from layers.forward_batch import ForwardBatch
from qwen35.cuda_graphs import collector_paused

log = logging.getLogger("qwen35.graphs")

FIRST_BUCKET = 256


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: FIRST_BUCKET, then alternately x1.5 and x4/3 (256, 384, 512, 768, 1024, ...), the
    last the first >= max_tokens: a step of more than 256 tokens runs at most 1.5x its tokens."""
    sizes = [FIRST_BUCKET]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 3 // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3)
    return sizes


def padded_rows(slots: list[int], starts: list[int], tokens: list[list[int]], n: int, seqs: int, pad_slot: int,
                pad_len: int) -> list[int] | None:
    """The flat static rows of a step padded to n tokens and `seqs` sequences: slots [seqs], starts [seqs],
    cu_seqlens [seqs + 1], tokens [n] (int64 values). Padding sequences take pad_slot at position 0, at most pad_len
    tokens each (the scratch block table's reach); None where the step does not fit."""
    lens = [len(t) for t in tokens]
    pad = n - sum(lens)
    pads = -(-pad // pad_len) if pad > 0 else 0
    if pad < 0 or len(slots) + pads > seqs:
        return None
    pad_lens = [pad_len] * (pads - 1) + [pad - pad_len * (pads - 1)] if pads else []
    empty = seqs - len(slots) - pads
    all_lens = lens + pad_lens + [0] * empty
    return (list(slots) + [pad_slot] * (pads + empty) + list(starts) + [0] * (pads + empty)
            + [0, *itertools.accumulate(all_lens)] + [t for row in tokens for t in row] + [0] * pad)


def packed_tokens(cu: torch.Tensor, starts: torch.Tensor, tables: torch.Tensor, n: int, block_size: int):
    """Per packed token of a varlen batch (sequences cu [B+1], starting at `starts` [B], block tables [B, W]; n
    tokens): (its sequence, its position, its KV slot), as device ops only (no host sync): runner.prepare's
    prefill batch and the prefill graphs' both build theirs here."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(starts), device=cu.device), cu.diff(), output_size=n)
    positions = (starts - cu[:-1])[seq_of_token] + torch.arange(n, device=cu.device)
    blocks = tables[seq_of_token, positions // block_size]
    return seq_of_token, positions, blocks.long() * block_size + positions % block_size


def prefill_batch(runner, rows: torch.Tensor, n: int, seqs: int) -> ForwardBatch:
    """The ForwardBatch of padded rows (padded_rows' layout, int64 on the device) as device ops only, so that a
    graph holds them: runner.prepare's prefill part over whole block tables."""
    slots, starts, cu = rows[:seqs], rows[seqs:2 * seqs], rows[2 * seqs:3 * seqs + 1]
    tokens = rows[3 * seqs + 1:3 * seqs + 1 + n]
    tables = runner.block_table[slots]
    _, positions, slot_mapping = packed_tokens(cu, starts, tables, n, runner.block_size)
    return ForwardBatch(
        input_ids=tokens, positions=positions, slot_mapping=slot_mapping, cu_seqlens=cu.to(torch.int32),
        start_pos=starts.to(torch.int32), context_lens=(starts + cu.diff()).to(torch.int32),
        block_tables=tables, state_slots=slots, logits_indices=None, seq_lens_cpu=[0] * seqs,
        start_pos_cpu=[0] * seqs, state_slots_cpu=[runner.scratch_slot] * seqs, is_decode=False)


class PrefillGraphs:
    def __init__(self, runner, max_tokens: int, pool=None):
        self.runner = runner
        self.seqs = runner.max_num_seqs + 1  # the callers' rows and at least one padding sequence
        self.pad_len = runner.block_table.shape[1] * runner.block_size
        # (a bucket past seqs * pad_len tokens could not be captured: its padding would not fit the sequences)
        self.sizes = [n for n in prefill_buckets(max_tokens) if n <= self.seqs * self.pad_len]
        # the static rows (padded_rows' layout for the largest bucket): written by one copy per step
        self.rows = torch.zeros(3 * self.seqs + 1 + max(self.sizes, default=0), dtype=torch.int64,
                                device=runner.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.replays = 0  # steps run from a graph
        self._capture_all()

    @collector_paused()
    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.time()
        runner, model = self.runner, self.runner.model
        for n in reversed(self.sizes):  # largest first: pool reuse
            rows = padded_rows([], [], [], n, self.seqs, runner.scratch_slot, self.pad_len)
            self.rows[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
            model(prefill_batch(runner, self.rows, n, self.seqs))  # outside the graph first (compiles, lazy inits)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = model(prefill_batch(runner, self.rows, n, self.seqs))
            self.graphs[n] = (graph, out)
            # once as a call runs it: the graph's first launch uploads it, the first pinned rows of a size are
            # allocated (a caller's first prefill call had paid ~2 ms more host time)
            self.run(n, rows, [n])
        self.replays = 0
        torch.cuda.synchronize()
        log.info("captured %d prefill CUDA graphs (%s tokens) in %.1f s", len(self.graphs), self.sizes,
                 time.time() - t0)

    def rows_for(self, slots: list[int], starts: list[int], tokens: list[list[int]]) -> tuple[int, list[int]] | None:
        """(bucket, padded rows) of the smallest graph that holds a step of these rows (each with tokens, from
        `starts`), or None where none does (the caller runs it eagerly)."""
        n = next((s for s in self.sizes if s >= sum(map(len, tokens))), None)
        rows = None if n is None else padded_rows(slots, starts, tokens, n, self.seqs, self.runner.scratch_slot,
                                                  self.pad_len)
        return None if rows is None else (n, rows)

    def run(self, n: int, rows: list[int], lens: list[int]) -> torch.Tensor:
        """Replay bucket n's graph on rows_for's rows; the final-norm hidden states of each row's last token [rows,
        H] (lens: the rows' token counts)."""
        self.rows[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int64, pin_memory=self.runner._pin),
                                    non_blocking=True)
        graph, out = self.graphs[n]
        graph.replay()
        self.replays += 1
        last = torch.tensor(list(itertools.accumulate(lens)), dtype=torch.int64, pin_memory=self.runner._pin)
        return out[last.to(out.device, non_blocking=True) - 1]
