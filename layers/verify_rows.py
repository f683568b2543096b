"""A verify step's row inputs (speculative decoding, qwen35/runner.py verify_inputs) from the slots' device buffers:
verify_rows_torch / verify_rows_fast, bound once by the runner (bind_verify_rows).

Row b of the step (slot s, newest token at position start) becomes T rows b*T .. b*T + T - 1: its newest token, then
its T - 1 drafts, at positions start .. start + T - 1, each over the slot's whole block table. Positions past the
slot's last covered position (slot_end) compute garbage that is never accepted: their K/V go to the scratch block,
their RoPE position is clamped to slot_end, and they may accept no draft (num_drafts).

A row planned while the host is one verify step behind (behind[b] = 1: the engine queued this step before it read
the last one's tokens) starts past the host's position by the drafts its slot accepted at that step (accepted[s],
written by the step itself: runner.verify_forward); every other row starts where the host says. The torch one is
~30 small kernels inside every verify graph (~2 us each in a replay); the fast one is one launch, a program per row.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from layers import backend
from layers.backend import pdl, prior_done, tl, triton


class VerifyRows(NamedTuple):
    input_ids: torch.Tensor       # [B * T] int64
    positions: torch.Tensor       # [B * T] int64, clamped to the slot's last covered position
    slot_mapping: torch.Tensor    # [B * T] int64: where each row's K/V go (the scratch block past the slot's blocks)
    context_lens: torch.Tensor    # [B * T] int32: position + 1
    block_tables: torch.Tensor    # [B * T, width]: the slot's table, once per row
    cu_seqlens: torch.Tensor      # [B + 1] int32: 0, T, 2T, ...
    start_pos: torch.Tensor       # [B] int32
    logits_indices: torch.Tensor  # [B * T] int64: 0 .. B * T - 1
    num_drafts: torch.Tensor      # [B] int64: the drafts row b may accept (those whose positions have KV blocks)


def verify_rows_torch(slots: torch.Tensor, starts: torch.Tensor, behind: torch.Tensor, T: int,
                      slot_end: torch.Tensor, block_table: torch.Tensor, slot_tokens: torch.Tensor,
                      drafts: torch.Tensor, accepted: torch.Tensor, block_size: int, scratch_block: int) -> VerifyRows:
    """slots, starts, behind: [B] int64 (the host's start positions; behind 0 or 1); slot_end [slots] int64 (the last
    position each slot's blocks cover); block_table [slots, width] (spare columns past every table, so a draft position
    past the blocks reads in bounds); slot_tokens [slots] int64 (each slot's newest token); drafts [draft rows, K] int64
    (a slot's row is its own, the scratch slot's the last: slots clamped to draft rows - 1); accepted [slots] int64 (the
    drafts each slot accepted at its last verify step)."""
    B, device = slots.shape[0], slots.device
    starts = starts + behind * accepted[slots]
    end = slot_end[slots]
    positions = starts[:, None] + torch.arange(T, device=device)[None, :]
    valid = positions <= end[:, None]
    tables = block_table[slots]
    blocks = torch.where(valid, tables.gather(1, positions // block_size), scratch_block)
    rows = slots.clamp(max=drafts.shape[0] - 1)
    tokens = torch.cat([slot_tokens[slots, None], drafts[rows, :T - 1]], dim=1)
    return VerifyRows(tokens.flatten(), torch.minimum(positions, end[:, None]).flatten(),
                      (blocks.long() * block_size + positions % block_size).flatten(),
                      (positions + 1).flatten().to(torch.int32), tables.repeat_interleave(T, dim=0),
                      torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device), starts.to(torch.int32),
                      torch.arange(B * T, device=device), (end - starts).clamp(0, T - 1))


def verify_rows_fast(slots: torch.Tensor, starts: torch.Tensor, behind: torch.Tensor, T: int,
                     slot_end: torch.Tensor, block_table: torch.Tensor, slot_tokens: torch.Tensor,
                     drafts: torch.Tensor, accepted: torch.Tensor, block_size: int, scratch_block: int) -> VerifyRows:
    """verify_rows_torch in one launch: a program per row b writes its T rows (the table copies included)."""
    B, device, width = slots.shape[0], slots.device, block_table.shape[1]
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    out = VerifyRows(torch.empty(B * T, **i64), torch.empty(B * T, **i64), torch.empty(B * T, **i64),
                     torch.empty(B * T, **i32), torch.empty(B * T, width, dtype=block_table.dtype, device=device),
                     torch.empty(B + 1, **i32), torch.empty(B, **i32), torch.empty(B * T, **i64),
                     torch.empty(B, **i64))
    if B:
        _verify_rows_kernel[(B,)](slots, starts, behind, slot_end, block_table, slot_tokens, drafts, accepted,
                                  *out, B, T,
                                  block_table.stride(0), drafts.stride(0), drafts.shape[0] - 1, width, block_size,
                                  scratch_block, BLOCK_T=triton.next_power_of_2(drafts.shape[1] + 1),
                                  BLOCK_W=triton.next_power_of_2(width), **pdl())
    return out


def bind_verify_rows() -> Callable[..., VerifyRows]:
    """verify_rows_fast or verify_rows_torch, as the kernel set chosen at start says (layers/backend.py)."""
    return verify_rows_fast if backend.use_fast() else verify_rows_torch


if triton is not None:
    @triton.jit(do_not_specialize=["B", "T", "last_draft_row", "block_size", "scratch_block"])
    def _verify_rows_kernel(slots_ptr, starts_ptr, behind_ptr, end_ptr, table_ptr, tok_ptr, drafts_ptr,
                            accepted_ptr, ids_ptr, pos_ptr,
                            map_ptr, ctx_ptr, tables_ptr, cu_ptr, start_out_ptr, logit_ptr, nd_ptr, B, T,
                            stride_table, stride_drafts, last_draft_row, width, block_size, scratch_block,
                            BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        """Program b: row b's T rows (BLOCK_T >= T: the widest verify step the draft buffers hold, one compile)."""
        prior_done()  # (backend.pdl: the kernels before this one have finished)
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b)
        start = tl.load(starts_ptr + b) + tl.load(behind_ptr + b) * tl.load(accepted_ptr + slot)
        end = tl.load(end_ptr + slot)
        j = tl.arange(0, BLOCK_T)
        jm = j < T
        pos = start + j
        valid = pos <= end
        blk = tl.load(table_ptr + slot * stride_table + pos // block_size, mask=jm & valid, other=0)
        blk = tl.where(valid, blk.to(tl.int64), scratch_block)
        newest = tl.load(tok_ptr + slot)
        draft_row = tl.minimum(slot, last_draft_row)
        drafted = tl.load(drafts_ptr + draft_row * stride_drafts + j - 1, mask=jm & (j > 0), other=0)
        row = b * T + j
        tl.store(ids_ptr + row, tl.where(j == 0, newest, drafted), mask=jm)
        tl.store(pos_ptr + row, tl.minimum(pos, end), mask=jm)
        tl.store(map_ptr + row, blk * block_size + pos % block_size, mask=jm)
        tl.store(ctx_ptr + row, (pos + 1).to(tl.int32), mask=jm)
        tl.store(logit_ptr + row, row.to(tl.int64), mask=jm)
        tl.store(start_out_ptr + b, start.to(tl.int32))
        tl.store(nd_ptr + b, tl.minimum(tl.maximum(end - start, 0), T - 1))
        tl.store(cu_ptr + b, (b * T).to(tl.int32))
        if b == B - 1:
            tl.store(cu_ptr + B, (B * T).to(tl.int32))
        cols = tl.arange(0, BLOCK_W)
        cm = cols < width
        table_row = tl.load(table_ptr + slot * stride_table + cols, mask=cm)
        for t in range(T):
            tl.store(tables_ptr + (b * T + t).to(tl.int64) * width + cols, table_row, mask=cm)
