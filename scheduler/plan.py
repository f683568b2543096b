"""StepPlan: the batch metadata that rank 0 broadcasts to every rank before each forward step.

Plain Python lists only (cheap to pickle and broadcast). The scheduler builds it from request state; every rank's
ModelRunner turns it into device tensors. Sequences are ordered decodes first (one token each), then prefill chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    # one entry per sequence in the batch
    state_slots: list[int] = field(default_factory=list)      # DeltaNet state slot (conv + recurrent state) of each sequence
    token_ids: list[list[int]] = field(default_factory=list)  # tokens fed this step: a prefill chunk, or 1 decode token
    start_pos: list[int] = field(default_factory=list)        # tokens of the sequence already in its caches; 0 = fresh state
    block_tables: list[list[int]] = field(default_factory=list)  # paged-KV block ids covering start_pos + len(token_ids)
    want_logits: list[bool] = field(default_factory=list)     # True: return logits of this sequence's last token
    # prefix cache: copies done in order before the forward (DeltaNet state slots, and paged-KV blocks)
    copy_states: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # control: "step" runs the forward; "exit" makes worker ranks leave their loop; "idle" is a heartbeat an idle
    # server sends so that worker ranks waiting in broadcast_object do not hit the process-group timeout
    command: str = "step"

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def is_pure_decode(self) -> bool:
        return all(len(t) == 1 and p > 0 for t, p in zip(self.token_ids, self.start_pos))
