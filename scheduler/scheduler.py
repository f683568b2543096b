"""Continuous batching with chunked prefill (rank 0 only): admission, capacity and batching, nothing else.

Policy (simple and safe): a request is admitted only when a DeltaNet state slot and KV blocks for its whole
life (prompt + max_tokens) are free; it keeps them until its last token is scheduled, it finishes or it is aborted.
A running request therefore never runs out of memory mid-generation, so there is no preemption; when capacity is
short, requests wait in arrival order. Each step takes one token from every decoding request first, then fills the
rest of the token budget with prefill chunks: partially prefilled requests first (oldest first), then newly
admitted ones.

Tokens are counted when they are scheduled, not when their step has run: the next step can be planned while the
device still runs this one (the engine's overlap). A decode row feeds the token sampled for its slot at the step
before, which stays on the device. A request whose last token is scheduled gives its slot and blocks back at once:
the only steps that could still touch them are already queued on the device, ahead of any step that reuses them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.plan import StepPlan
from scheduler.pools import BlockPool, StateSlotPool
from scheduler.prefix_cache import CacheEntry, PrefixCache
from scheduler.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    plan: StepPlan
    rows: list[Request] = field(default_factory=list)      # the request of each row of the plan
    sampled: list[Request] = field(default_factory=list)   # the requests of the logits rows, in row order
    admitted: list[Request] = field(default_factory=list)  # admitted in this step
    num_prompt_tokens: int = 0                              # prompt tokens fed (prefill chunks)


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
        # whole-prompt prefix cache (scheduler/prefix_cache.py); off without snapshot slots
        self.cache = PrefixCache(list(snapshot_slots)) if snapshot_slots else None
        self._copy_states: list[tuple[int, int]] = []  # (src slot, dst slot), run before the next forward
        self._copy_blocks: list[tuple[int, int]] = []

    # ---- admission -------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (checked where it came in: RequestLimits)."""
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
    def schedule(self) -> ScheduledStep:
        """The next step's plan; every token in it counts as computed from now on."""
        for req in self.running:
            if req.snapshot_at is not None and req.num_computed == req.snapshot_at:
                self._snapshot(req)
        step, budget = ScheduledStep(StepPlan()), self.max_num_batched_tokens
        for req in self.running:
            if not req.is_prefilling:
                self._add_row(step, req, [], [])
                budget -= 1
        for req in self.running:
            if req.is_prefilling and budget > 0:
                budget -= self._add_chunk(step, req, budget, [])
        while budget > 0:
            req = self._admit()
            if req is None:
                break
            step.admitted.append(req)
            budget -= self._add_chunk(step, req, budget, req.block_ids)
        # the snapshots taken above and the cache hits admitted: copied in this order before the forward
        step.plan.copy_states, step.plan.copy_blocks = self._copy_states, self._copy_blocks
        self._copy_states, self._copy_blocks = [], []
        for req in step.sampled:
            if req.num_scheduled == req.params.max_tokens:
                self.free(req)
        return step

    def _add_chunk(self, step: ScheduledStep, req: Request, budget: int, table: list[int]) -> int:
        # a prompt to be cached stops one token short, so that its state can be snapshotted before the last one
        end = req.snapshot_at if req.snapshot_at is not None else req.num_prompt_tokens
        n = min(end - req.num_computed, budget)
        self._add_row(step, req, req.prompt_ids[req.num_computed:req.num_computed + n], table)
        step.num_prompt_tokens += n
        return n

    @staticmethod
    def _add_row(step: ScheduledStep, req: Request, tokens: list[int], table: list[int]) -> None:
        """A row feeding `tokens` ([] = the token sampled for it last, on the device); it wants logits when it
        reaches the end of everything known, that is when a completion token follows it."""
        plan = step.plan
        step.rows.append(req)
        plan.state_slots.append(req.state_slot)
        plan.token_ids.append(tokens)
        plan.start_pos.append(req.num_computed)
        plan.block_tables.append(table)
        req.num_computed += len(tokens) or 1
        want = req.num_computed >= req.num_prompt_tokens
        plan.want_logits.append(want)
        if want:
            req.num_scheduled += 1
            step.sampled.append(req)

    # ---- leaving ---------------------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Take a request out of the scheduler wherever it is and return what it holds (nothing twice)."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.slots.free([req.state_slot])
            self.blocks.free(req.block_ids[req.num_shared_blocks:])  # the shared ones belong to the cache entry
            if req.cache_entry is not None:
                req.cache_entry.users -= 1
            req.state_slot, req.block_ids, req.cache_entry = None, [], None
        req.status = RequestStatus.RELEASED

    # ---- metrics -------------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
