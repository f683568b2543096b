"""StepPlan: one forward step's batch metadata, as rank 0 sends it to every rank.

Rows address the caches by DeltaNet state slot only: each rank's ModelRunner keeps, per slot, the paged-KV block
table and the token last sampled for it, both on the device. So a row says where it starts and which tokens it
feeds; a row with no tokens feeds one, the token sampled for its slot at the step before, which the host may not
have seen yet (that is what lets the host prepare step N+1 while the device runs step N). A row's block table
travels only when it is set or changed (at admission): an empty list keeps the slot's table as it is.

The prefix cache (scheduler/prefix_cache.py) adds two things: copies run before the forward, in order (DeltaNet
state slots and paged-KV blocks: a hit's snapshot into its slot, a snapshot taken from a slot after the step
before), and checkpoints (row, position, snapshot slot): the DeltaNet prefill kernels also write the state the
row has after `position` tokens into that slot, in the same launch.

On the wire a plan is one int64 tensor (encode / decode, exact round trip): no pickling per step.
    header   version, command, rows, host tokens, table entries, state copies, block copies, checkpoints
    rows     per row: slot, start_pos, number of host tokens, want_logits, number of table entries
    then     the host tokens of every row, the table entries of every row, the state copies, the block copies,
             the checkpoints
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

COMMANDS = ("step", "idle", "exit")
VERSION = 2
HEADER = 8
ROW = 5


@dataclass
class StepPlan:
    # one entry per row (sequence) of the batch; the scheduler orders decodes first, then prefill chunks
    state_slots: list[int] = field(default_factory=list)      # DeltaNet state slot of each row
    token_ids: list[list[int]] = field(default_factory=list)  # tokens fed; [] = one token, the slot's last sampled
    start_pos: list[int] = field(default_factory=list)        # tokens of the row already in its caches; 0 = fresh
    block_tables: list[list[int]] = field(default_factory=list)  # the slot's KV block table from column 0; [] = kept
    want_logits: list[bool] = field(default_factory=list)     # True: return logits of this row's last token
    # prefix cache: copies done in order before the forward (DeltaNet state slots, and paged-KV blocks), and
    # checkpoints (row, absolute position, destination slot) written by the DeltaNet prefill kernels
    copy_states: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)
    # control: "step" runs the forward; "exit" makes worker ranks leave their loop; "idle" is a heartbeat an idle
    # server sends so that worker ranks waiting for the next plan do not hit the process-group timeout
    command: str = "step"

    @property
    def num_seqs(self) -> int:
        return len(self.state_slots)

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) or 1 for t in self.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def is_pure_decode(self) -> bool:
        return all(len(t) <= 1 and p > 0 for t, p in zip(self.token_ids, self.start_pos))

    def encode(self) -> torch.Tensor:
        """The plan as one int64 CPU tensor."""
        n_tok = sum(len(t) for t in self.token_ids)
        n_tab = sum(len(t) for t in self.block_tables)
        out = [VERSION, COMMANDS.index(self.command), self.num_seqs, n_tok, n_tab, len(self.copy_states),
               len(self.copy_blocks), len(self.checkpoints)]
        for row in zip(self.state_slots, self.start_pos, self.token_ids, self.want_logits, self.block_tables):
            out += (row[0], row[1], len(row[2]), int(row[3]), len(row[4]))
        for t in self.token_ids:
            out += t
        for t in self.block_tables:
            out += t
        for pair in self.copy_states:
            out += pair
        for pair in self.copy_blocks:
            out += pair
        for triple in self.checkpoints:
            out += triple
        return torch.tensor(out, dtype=torch.int64)

    @classmethod
    def decode(cls, packed: torch.Tensor) -> "StepPlan":
        v = packed.tolist()
        if len(v) < HEADER:
            raise ValueError(f"not a step plan ({len(v)} values)")
        version, command, rows, n_tok, n_tab, n_cs, n_cb, n_ck = v[:HEADER]
        if version != VERSION or len(v) != HEADER + ROW * rows + n_tok + n_tab + 2 * (n_cs + n_cb) + 3 * n_ck:
            raise ValueError(f"not a step plan of version {VERSION} ({len(v)} values, header {v[:HEADER]})")
        r = v[HEADER:HEADER + ROW * rows]
        plan = cls(state_slots=r[0::ROW], start_pos=r[1::ROW], want_logits=[bool(w) for w in r[3::ROW]],
                   command=COMMANDS[command])
        at = HEADER + ROW * rows
        for lens, out in ((r[2::ROW], plan.token_ids), (r[4::ROW], plan.block_tables)):
            for n in lens:
                out.append(v[at:at + n])
                at += n
        plan.copy_states = [(v[i], v[i + 1]) for i in range(at, at + 2 * n_cs, 2)]
        at += 2 * n_cs
        plan.copy_blocks = [(v[i], v[i + 1]) for i in range(at, at + 2 * n_cb, 2)]
        at += 2 * n_cb
        plan.checkpoints = [(v[i], v[i + 1], v[i + 2]) for i in range(at, at + 3 * n_ck, 3)]
        return plan
