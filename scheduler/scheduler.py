"""Continuous batching with chunked prefill (rank 0 only).

Policy (simple and safe): a request is admitted only when a DeltaNet state slot and KV blocks for its whole
life (prompt + max_tokens) are free; it keeps them until it finishes or is aborted. A running request therefore
never runs out of memory mid-generation, so there is no preemption; when capacity is short, requests wait in
arrival order. Each step takes one token from every decoding request first, then fills the rest of the token
budget with prefill chunks: partially prefilled requests first (oldest first), then newly admitted ones.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.plan import StepPlan
from scheduler.pools import BlockPool, StateSlotPool
from scheduler.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_tokens: int       # tokens fed this step
    want_logits: bool     # a token is sampled for this request after the step


class Scheduler:
    def __init__(self, num_kv_blocks: int, block_size: int, num_state_slots: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.blocks = BlockPool(num_kv_blocks, block_size)
        self.slots = StateSlotPool(num_state_slots)
        self.max_num_seqs = min(max_num_seqs, num_state_slots)
        # every running request decodes one token per step, so the budget must hold a full decode batch
        if max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= the number of "
                             f"concurrent sequences ({self.max_num_seqs})")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # admission order
        self.requests: dict[str, Request] = {}

    # ---- admission -------------------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when a request could never be admitted, even into an empty engine."""
        need = self.blocks.blocks_for(num_prompt_tokens + max_tokens - 1)
        if need > self.blocks.size:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{self.blocks.block_size} tokens, but the KV cache holds only {self.blocks.size} blocks "
                f"({self.blocks.size * self.blocks.block_size} tokens)")

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _admit(self) -> Request | None:
        if not self.waiting or len(self.running) >= self.max_num_seqs or not self.slots.num_free:
            return None
        req = self.waiting[0]
        need = self.blocks.blocks_for(req.max_cached_tokens)
        if need > self.blocks.num_free:
            return None  # head of line waits: admitting smaller requests past it could starve it forever
        self.waiting.popleft()
        req.state_slot = self.slots.allocate(1)[0]
        req.block_ids = self.blocks.allocate(need)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[ScheduledSeq]]:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for req in self.running:
            if not req.is_prefilling:
                seqs.append(ScheduledSeq(req, 1, True))
                budget -= 1
        for req in self.running:
            if req.is_prefilling and budget > 0:
                budget -= self._add_chunk(seqs, req, budget)
        while budget > 0:
            req = self._admit()
            if req is None:
                break
            budget -= self._add_chunk(seqs, req, budget)
        return self._build_plan(seqs), seqs

    @staticmethod
    def _add_chunk(seqs: list[ScheduledSeq], req: Request, budget: int) -> int:
        n = min(req.num_prompt_tokens - req.num_computed, budget)
        seqs.append(ScheduledSeq(req, n, req.num_computed + n == req.num_prompt_tokens))
        return n

    def _build_plan(self, seqs: list[ScheduledSeq]) -> StepPlan:
        plan = StepPlan()
        for s in seqs:
            r, start = s.request, s.request.num_computed
            plan.state_slots.append(r.state_slot)
            plan.token_ids.append([r.token_at(i) for i in range(start, start + s.num_tokens)])
            plan.start_pos.append(start)
            plan.block_tables.append(r.block_ids[:self.blocks.blocks_for(start + s.num_tokens)])
            plan.want_logits.append(s.want_logits)
        return plan

    def update(self, seqs: list[ScheduledSeq], sampled: list[int]) -> list[Request]:
        """Record a finished forward step; `sampled` holds one token per want_logits sequence, in plan order.
        Returns the requests that received a new token (the caller checks them for stop conditions)."""
        it = iter(sampled)
        grew = []
        for s in seqs:
            s.request.num_computed += s.num_tokens
            if s.want_logits:
                s.request.output_ids.append(next(it))
                grew.append(s.request)
        return grew

    # ---- leaving ---------------------------------------------------------------------------------------------
    def finish(self, request: Request, reason: str) -> None:
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; returns it, or None for an unknown (e.g. already finished) id."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = "abort"
        return req

    def _release(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.slots.free([req.state_slot])
            self.blocks.free(req.block_ids)
            req.state_slot, req.block_ids = None, []
        del self.requests[req.request_id]

    # ---- metrics -------------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
