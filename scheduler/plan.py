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

Speculative decoding (scheduler/speculation.py) adds two step-wide integers: spec_k, the drafts every row of a
verify step feeds after its newest token (the runner holds both on the device; 0: a plain step), and draft_k, the
drafts the step proposes at its end for each row it samples (read by the next step's verify; 0: none; the runner
writes the MTP head's KV at every step's positions either way), and a flag,
spec_behind: this verify step was planned before the host read the tokens of the verify step before it (the
engine's overlap), so each row starts past its start_pos by the drafts its slot accepted there (the runner keeps
them on the device).

On the wire a plan is a list of integers (encode / decode, exact round trip; the engine sends it with
dist.parallel.broadcast_ints): no pickling per step.
    header   version, command, rows, host tokens, table entries, state copies, block copies, checkpoints, spec_k,
             draft_k, spec_behind
    columns  the rows' slots, start_pos, numbers of host tokens, want_logits, numbers of table entries
    then     the host tokens of every row, the table entries of every row, the state copies, the block copies,
             the checkpoints
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

def can_checkpoint(start: int, n: int, pos: int, chunk: int) -> bool:
    """Whether the DeltaNet prefill kernels can write a row's state after `pos` tokens: the row (n tokens from
    position start) runs them, which one token on a state does not (it runs the decode op), and pos is inside it, a
    multiple of their `chunk` from the row's start or the row's end. The scheduler cuts rows by it, the runner
    refuses plans against it."""
    return (n > 1 or start == 0) and start < pos <= start + n and ((pos - start) % chunk == 0 or pos == start + n)


COMMANDS = ("step", "idle", "exit")
VERSION = 5
HEADER = 11
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
    # speculative decoding (module docstring): drafts verified per row in this step, drafts proposed at its end,
    # and whether its rows' start positions are one verify step behind (1) or exact (0)
    spec_k: int = 0
    draft_k: int = 0
    spec_behind: int = 0

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
        # (C-level passes: a check of every step's rows)
        return bool(self.token_ids) and max(map(len, self.token_ids)) <= 1 and min(self.start_pos) > 0

    def encode(self) -> list[int]:
        """The plan as a list of integers (columns, so that every part is one C-level extend, not a loop per row)."""
        toks, tabs = self.token_ids, self.block_tables
        n_tok, n_tab = list(map(len, toks)), list(map(len, tabs))
        out = [VERSION, COMMANDS.index(self.command), len(self.state_slots), sum(n_tok), sum(n_tab),
               len(self.copy_states), len(self.copy_blocks), len(self.checkpoints), self.spec_k, self.draft_k,
               self.spec_behind]
        out += self.state_slots
        out += self.start_pos
        out += n_tok
        out += map(int, self.want_logits)
        out += n_tab
        out += chain.from_iterable(toks)
        out += chain.from_iterable(tabs)
        out += chain.from_iterable(self.copy_states)
        out += chain.from_iterable(self.copy_blocks)
        out += chain.from_iterable(self.checkpoints)
        return out

    @classmethod
    def decode(cls, v: list[int]) -> "StepPlan":
        if len(v) < HEADER:
            raise ValueError(f"not a step plan ({len(v)} values)")
        version, command, rows, n_tok, n_tab, n_cs, n_cb, n_ck, spec_k, draft_k, behind = v[:HEADER]
        if version != VERSION or len(v) != HEADER + ROW * rows + n_tok + n_tab + 2 * (n_cs + n_cb) + 3 * n_ck:
            raise ValueError(f"not a step plan of version {VERSION} ({len(v)} values, header {v[:HEADER]})")
        col = [v[HEADER + i * rows:HEADER + (i + 1) * rows] for i in range(ROW)]
        plan = cls(state_slots=col[0], start_pos=col[1], want_logits=list(map(bool, col[3])),
                   command=COMMANDS[command], spec_k=spec_k, draft_k=draft_k, spec_behind=behind)
        at = HEADER + ROW * rows
        for lens, total, out in ((col[2], n_tok, plan.token_ids), (col[4], n_tab, plan.block_tables)):
            if not total:  # every row empty (a decode step's tokens, most steps' tables)
                out += ([] for _ in range(rows))
                continue
            for n in lens:
                out.append(v[at:at + n])
                at += n
        plan.copy_states = [(v[i], v[i + 1]) for i in range(at, at + 2 * n_cs, 2)]
        at += 2 * n_cs
        plan.copy_blocks = [(v[i], v[i + 1]) for i in range(at, at + 2 * n_cb, 2)]
        at += 2 * n_cb
        plan.checkpoints = [(v[i], v[i + 1], v[i + 2]) for i in range(at, at + 3 * n_ck, 3)]
        return plan
