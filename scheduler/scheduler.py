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
from scheduler.prefix_cache import CacheEntry, PrefixCache
from scheduler.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_tokens: int       # tokens fed this step
    want_logits: bool     # a token is sampled for this request after the step


class Scheduler:
    def __init__(self, num_kv_blocks: int, block_size: int, num_state_slots: int, max_num_seqs: int,
                 max_num_batched_tokens: int, snapshot_slots: list[int] = ()):
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
        # whole-prompt prefix cache (scheduler/prefix_cache.py); off without snapshot slots
        self.cache = PrefixCache(list(snapshot_slots)) if snapshot_slots else None
        self._copy_states: list[tuple[int, int]] = []  # (src slot, dst slot), run before the next forward
        self._copy_blocks: list[tuple[int, int]] = []

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
        hit = self.cache.lookup(req.prompt_ids) if self.cache else None
        shared = len(hit.key) // self.blocks.block_size if hit else 0  # full blocks read from the cache entry
        need = self.blocks.blocks_for(req.max_cached_tokens) - shared
        if not self._make_room(need, keep=hit):
            return None  # head of line waits: admitting smaller requests past it could starve it forever
        self.waiting.popleft()
        req.state_slot = self.slots.allocate(1)[0]
        req.block_ids = (hit.blocks[:shared] if hit else []) + self.blocks.allocate(need)
        req.status = RequestStatus.RUNNING
        if hit:
            self._attach(req, hit, shared)
            self._copy_states.append((hit.snapshot_slot, req.state_slot))
            if len(hit.key) % self.blocks.block_size:  # the partial block: a private copy to write on into
                self._copy_blocks.append((hit.blocks[shared], req.block_ids[shared]))
            req.num_computed = len(hit.key)
        elif self.cache and req.num_prompt_tokens >= 2:
            req.snapshot_at = req.num_prompt_tokens - 1
        self.running.append(req)
        return req

    # ---- prefix cache ----------------------------------------------------------------------------------------
    @staticmethod
    def _attach(req: Request, entry: CacheEntry, shared: int) -> None:
        req.cache_entry, req.num_shared_blocks = entry, shared
        entry.users += 1

    def _evict(self, keep: CacheEntry | None = None) -> bool:
        """Drop the LRU unused cache entry (never `keep`) and free its blocks; False if there is none."""
        entry = self.cache.evict_one(keep) if self.cache else None
        if entry is not None:
            self.blocks.free(entry.blocks)
        return entry is not None

    def _make_room(self, num_blocks: int, keep: CacheEntry | None = None) -> bool:
        """Evict unused cache entries (LRU) until `num_blocks` KV blocks are free; False if they cannot be."""
        while self.blocks.num_free < num_blocks and self._evict(keep):
            pass
        return self.blocks.num_free >= num_blocks

    def _snapshot(self, req: Request) -> None:
        """Cache the state of `req` after all but its last prompt token (its next forward feeds that token)."""
        req.snapshot_at = None
        if self.cache.contains(req.prompt_ids):
            return
        if not self.cache.free_slots and not self._evict():
            return
        n = req.num_prompt_tokens - 1
        full, partial = divmod(n, self.blocks.block_size)
        if partial and not self._make_room(1):
            return
        blocks = req.block_ids[:full] + (self.blocks.allocate(1) if partial else [])
        entry = CacheEntry(tuple(req.prompt_ids[:-1]), self.cache.free_slots.pop(), blocks)
        self.cache.add(entry)
        self._copy_states.append((req.state_slot, entry.snapshot_slot))
        if partial:
            self._copy_blocks.append((req.block_ids[full], blocks[-1]))
        self._attach(req, entry, full)  # its full blocks now belong to the entry; the request reads them

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[ScheduledSeq]]:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for req in self.running:
            if req.snapshot_at is not None and req.num_computed == req.snapshot_at:
                self._snapshot(req)
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
        # a prompt to be cached stops one token short, so that its state can be snapshotted before the last one
        end = req.snapshot_at if req.snapshot_at is not None else req.num_prompt_tokens
        n = min(end - req.num_computed, budget)
        seqs.append(ScheduledSeq(req, n, req.num_computed + n == req.num_prompt_tokens))
        return n

    def _build_plan(self, seqs: list[ScheduledSeq]) -> StepPlan:
        plan = StepPlan(copy_states=self._copy_states, copy_blocks=self._copy_blocks)
        self._copy_states, self._copy_blocks = [], []
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
            self.blocks.free(req.block_ids[req.num_shared_blocks:])  # the shared ones belong to the cache entry
            if req.cache_entry is not None:
                req.cache_entry.users -= 1
            req.state_slot, req.block_ids, req.cache_entry = None, [], None
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
