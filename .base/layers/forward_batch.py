"""ForwardBatch: one step's batch as device tensors (built by the runner from a StepPlan) plus the host-side lists
that the plain-torch reference path loops over without device syncs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [N] int64, packed tokens of all sequences
    positions: torch.Tensor      # [N] int64, absolute position of each token
    slot_mapping: torch.Tensor   # [N] int64, flat paged-KV slot (block * block_size + offset) of each token
    cu_seqlens: torch.Tensor     # [B+1] int32, token offsets of the sequences in the packed batch
    start_pos: torch.Tensor      # [B] int32, tokens already cached per sequence (0 = fresh state)
    context_lens: torch.Tensor   # [B] int32, start_pos + new tokens
    block_tables: torch.Tensor   # [B, max_blocks] int32, paged-KV blocks per sequence (padded with 0)
    state_slots: torch.Tensor    # [B] int64, DeltaNet state slot per sequence
    logits_indices: torch.Tensor  # [n_logits] int64, packed index of the tokens whose logits are wanted
    # host copies for the reference path
    seq_lens_cpu: list[int]
    start_pos_cpu: list[int]
    state_slots_cpu: list[int]
    is_decode: bool              # every sequence feeds exactly one token onto an existing state
    # prefix-cache checkpoints of the DeltaNet prefill: rows (sequence index, absolute position, destination slot),
    # [n, 3] int64 on the device, and the same on the host; none on a pure-decode step
    checkpoints: torch.Tensor | None = None
    checkpoints_cpu: list[tuple[int, int, int]] = field(default_factory=list)
    # a speculative verify step: every row feeds T = verify_tokens tokens (its newest, then its drafts) onto its
    # state, row b's at b*T .. b*T + T - 1; attention decodes every row as its own query (context_lens and
    # block_tables are then per row: [B*T], [B*T, W]; causal by the lengths), the DeltaNet layers verify without
    # writing their caches until commit (layers/deltanet_verify.py). 0: not one
    verify_tokens: int = 0
    # what layers derive from this batch once per step, keyed by the code that derives it (e.g. the DeltaNet layers'
    # split of a mixed step into decode rows and prefill sequences), so that every layer of the kind shares it
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
