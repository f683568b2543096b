"""Writing the paged KV cache's block tables, as a step's plan sets them: set_tables_torch / set_tables_fast, bound once
by the runner (bind_set_tables).

The host sends the tables a step sets as one flat int64 array, [slots | lengths | offsets | blocks] (n slots; table i
is blocks[offsets[i] : offsets[i] + lengths[i]]): one host-to-device copy. Both write table[slot, :length] and, where
a slot_end tensor is given (speculation clamps draft positions to it), slot_end[slot] = the last position the table
covers. The fast one is one launch, a program per slot; the torch one takes ~12 kernels (two cumulative sums, two
repeat_interleaves, an index_put) and ~0.6 ms of host time (the first decode call of 8 requests after their prefill,
1x H200, 2026-11-28), which a call that sends every table pays on top of its step.
"""
from __future__ import annotations

import itertools
from array import array
from typing import Callable

import torch

from layers import backend
from layers.backend import pdl, prior_done, tl, triton


def pack_tables(tables: list[tuple[int, list[int]]]) -> array:
    """The flat [slots | lengths | offsets | blocks] of (slot, table) pairs, as int64 (torch.frombuffer takes it)."""
    lens = [len(t) for _, t in tables]
    flat = array("q", [slot for slot, _ in tables])
    flat.extend(lens)
    flat.extend(itertools.accumulate(lens[:-1], initial=0))
    for _, t in tables:
        flat.extend(t)
    return flat


def set_tables_torch(table: torch.Tensor, flat: torch.Tensor, n: int, slot_end: torch.Tensor | None = None,
                     block_size: int = 0, max_len: int = 0) -> None:
    """table [slots, width] int32; flat (pack_tables, on table's device) of n tables; slot_end [slots] int64 or None,
    set to min(length * block_size, max_len) - 1."""
    slots, lens, offs, blocks = flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:]
    total = blocks.numel()
    rows = slots.repeat_interleave(lens, output_size=total)
    cols = torch.arange(total, device=flat.device) - offs.repeat_interleave(lens, output_size=total)
    table[rows, cols] = blocks.to(table.dtype)
    if slot_end is not None:
        slot_end[slots] = (lens * block_size).clamp_(max=max_len) - 1


def set_tables_fast(table: torch.Tensor, flat: torch.Tensor, n: int, slot_end: torch.Tensor | None = None,
                    block_size: int = 0, max_len: int = 0) -> None:
    """set_tables_torch in one launch: a program per table (each row of the table at once)."""
    if n == 0:
        return
    _set_tables_kernel[(n,)](table, flat, slot_end if slot_end is not None else flat, n, table.stride(0),
                             block_size, max_len, SLOT_END=slot_end is not None,
                             BLOCK=triton.next_power_of_2(table.shape[1]), **pdl())


def bind_set_tables() -> Callable[..., None]:
    """set_tables_fast or set_tables_torch, as the kernel set chosen at start says (layers/backend.py)."""
    return set_tables_fast if backend.use_fast() else set_tables_torch


if triton is not None:
    @triton.jit(do_not_specialize=["n", "block_size", "max_len"])
    def _set_tables_kernel(table_ptr, flat_ptr, end_ptr, n, stride, block_size, max_len, SLOT_END: tl.constexpr,
                           BLOCK: tl.constexpr):
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        i = tl.program_id(0)
        slot = tl.load(flat_ptr + i)
        length = tl.load(flat_ptr + n + i)
        off = tl.load(flat_ptr + 2 * n + i)
        cols = tl.arange(0, BLOCK)
        mask = cols < length
        blocks = tl.load(flat_ptr + 3 * n + off + cols, mask=mask)
        tl.store(table_ptr + slot * stride + cols, blocks.to(table_ptr.dtype.element_ty), mask=mask)
        if SLOT_END:
            tl.store(end_ptr + slot, tl.minimum(length * block_size, max_len) - 1)
