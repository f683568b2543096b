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

The prefix cache (scheduler/prefix_cache.py) is driven from here. At admission a request resumes from the deepest
snapshot on its prompt's cached chain: the snapshot is copied into its slot, the chain's full blocks go into its
block table (shared, read only), a partial block is copied into a block of its own, and only the rest of the prompt
is prefilled. As its prefill passes them, it snapshots: every `snapshot_interval` tokens (speculative), where its
prompt left a cached chain that had no snapshot there (the divergence point, rounded down to the chunk), and after
all but its last prompt token (so that the same prompt feeds one token); and when it ends on a stop, after the
tokens it fed. Each full block it computes joins the chain. A snapshot inside a prefill row is a checkpoint of the
DeltaNet prefill kernels, which needs the position to be a chunk multiple from the row's start or the row's end:
a row is cut at a snapshot position where needed. A snapshot at the end of a one-token row (which runs the decode
op) or after the reply is a copy of the request's slot in the next plan.

Speculative decoding (scheduler/speculation.py, on when a SpecPolicy is given): a step of decode rows alone
verifies the drafts the step before proposed (plan.spec_k, the same for every row: what that step proposed, 0
while a row's stop ids are still suppressed; a row near its max_tokens may accept fewer: the runner accepts none
past the row's KV blocks, and update() drops tokens past max_tokens);
every step that samples proposes drafts for the next one (plan.draft_k, the policy's choice for the running
batch; the runner writes the MTP head's KV at every step's positions, proposing or not).
A mixed step's decode rows take one token. A verify row counts one token when scheduled, like any decode
row; update() then takes a run of tokens per row (the accepted drafts and one more) and moves the request's counts
on by the extra ones. So a step planned before a verify step's runs are taken has its rows' positions behind by
them: only a verify step of the same rows may be planned so (schedule(behind=True), when verifies_next() says the
next step is one; plan.spec_behind tells the runner, which keeps the accepted counts on the device); the engine
takes the runs first before any other step. A request that a run ends while such a step is queued has had its
slot moved past its tokens: it is freed without a reply snapshot (update(..., followed=True)).

Ordering with the overlap: the device runs the plans in order, each plan's copies before its forward. A snapshot
written by plan N is read by hits from plan N+1 on; copies that must follow plan N's forward (a partial block, a
slot) travel in plan N+1, ahead of its hits; and nothing the plan being built reads or writes is evicted while it
is built, so a freed slot or block is only reused by work queued after the last work that touched it.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from scheduler.plan import StepPlan, can_checkpoint
from scheduler.pools import BlockPool, StateSlotPool
from scheduler.prefix_cache import Match, PrefixCache, check_snapshot_interval
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.speculation import SpecPolicy

log = logging.getLogger("qwen35.scheduler")


@dataclass
class ScheduledStep:
    plan: StepPlan
    rows: list[Request] = field(default_factory=list)      # the request of each row of the plan
    sampled: list[Request] = field(default_factory=list)   # the requests of the logits rows, in row order
    admitted: list[Request] = field(default_factory=list)  # admitted in this step: the plan's last rows, one each
    num_prompt_tokens: int = 0                              # prompt tokens fed (prefill chunks)
    # the step's first num_decode rows are the decode batch's (DecodeBatch), and decode_hints their sampling_hints,
    # worked out when the batch last changed
    num_decode: int = 0
    decode_hints: tuple | None = None
    joining: list[Request] = field(default_factory=list)   # whose prefill ends in this step: they decode from the next


NEVER = 1 << 62


class DecodeBatch:
    """The decode rows of the running requests that decode, in admission order (as the rows of a step list them),
    kept from step to step: a step takes these lists as they are (copies, when rows follow them), adds its number to
    the start positions and counts itself in `steps`, which moves every member's num_computed and num_scheduled on
    by one (Request.join_batch) without touching the requests. A request joins when its prefill is scheduled to
    end and leaves when it is freed.

    A list here is never written once made: joining and leaving make new ones, so that a plan (or a step's rows)
    holding them stays as it was built. The rows share one empty list for their tokens (fed from the device) and
    their block tables (kept)."""

    def __init__(self):
        self.reqs: list[Request] = []
        self.order: list[int] = []      # admission numbers, ascending
        self.slots: list[int] = []
        self.start: list[int] = []      # each one's num_computed less `steps`
        self.empty: list[list[int]] = []
        self.want: list[bool] = []
        self._none: list[int] = []
        self.steps = 0                  # steps taken
        self.ends_at = NEVER            # no member has all its tokens scheduled before `steps` reaches this
        self.hints: tuple | None = None  # sampling_hints of the members, worked out when a step needs them

    def join(self, reqs: list[Request]) -> None:
        """Requests whose prefill is scheduled to end (not members, none prefilling after the step being built)."""
        k = self.steps
        new = {"reqs": reqs, "order": [r.admission_no for r in reqs], "slots": [r.state_slot for r in reqs],
               "start": [r.num_computed - k for r in reqs], "empty": [self._none] * len(reqs),
               "want": [True] * len(reqs)}
        self.ends_at = min(self.ends_at, k + min(r.params.max_tokens - r.num_scheduled for r in reqs))
        self.hints = None
        for r in reqs:
            r.join_batch(self)
        if self.order and min(new["order"]) < self.order[-1]:  # not all behind the members: merge by admission
            order = self.order + new["order"]
            at = sorted(range(len(order)), key=order.__getitem__)
            for name, value in new.items():
                both = getattr(self, name) + value
                setattr(self, name, [both[i] for i in at])
        else:
            for name, value in new.items():
                setattr(self, name, getattr(self, name) + value)

    def leave(self, reqs: list[Request]) -> None:
        if len(reqs) == 1:
            i = self.reqs.index(reqs[0])
            cut = lambda old: old[:i] + old[i + 1:]  # noqa: E731
        else:
            gone = set(reqs)
            keep = [i for i, r in enumerate(self.reqs) if r not in gone]
            cut = lambda old: [old[i] for i in keep]  # noqa: E731
        self.hints = None
        for req in reqs:
            req.leave_batch()
        for name in ("reqs", "order", "slots", "start", "empty", "want"):
            setattr(self, name, cut(getattr(self, name)))

    def next_end(self) -> None:
        """ends_at for the members now (after a step that may have ended some)."""
        self.ends_at = self.steps + min((r.params.max_tokens - r.num_scheduled for r in self.reqs), default=NEVER)


class Scheduler:
    def __init__(self, num_kv_blocks: int, block_size: int, num_state_slots: int, max_num_seqs: int,
                 max_num_batched_tokens: int, snapshot_slots: list[int] = (), snapshot_interval: int = 0,
                 chunk: int = 64, stateless: bool = False, speculation: SpecPolicy | None = None):
        self.blocks = BlockPool(num_kv_blocks, block_size)
        self.slots = StateSlotPool(num_state_slots)
        self.max_num_seqs = min(max_num_seqs, num_state_slots)
        # every running request decodes one token per step, so the budget must hold a full decode batch
        if max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= the number of "
                             f"concurrent sequences ({self.max_num_seqs})")
        check_snapshot_interval(snapshot_interval, chunk)
        self.max_num_batched_tokens = max_num_batched_tokens
        # every request that has not ended, by id: queued, running, or with tokens still on the device
        self.requests: dict[str, Request] = {}
        self.completion_tokens = 0          # sampled tokens taken into their requests (update)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # admission order
        # the prefix cache; off without snapshot slots
        self.cache = PrefixCache(self.blocks, list(snapshot_slots), stateless) if snapshot_slots else None
        self.snapshot_interval, self.chunk = snapshot_interval, chunk
        self.step_no = 0                   # plans built so far: the one being built is step_no
        # copies (DeltaNet state slots, KV blocks) for the next plan that runs, before its forward; and those that
        # must wait for the forward of the plan being built (they go to the plan after it)
        self._copies: tuple[list, list] = ([], [])
        self._later: tuple[list, list] = ([], [])
        # the running requests that decode (their rows, kept from step to step), and those that prefill, each in
        # admission order
        self._decode = DecodeBatch()
        self._prefilling: list[Request] = []
        self._admissions = 0
        # speculative decoding: the policy (None: off) and the drafts the last planned step proposes
        self.speculation = speculation if speculation is not None and speculation.enabled else None
        self._drafted = 0

    # ---- admission -------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (checked where it came in: RequestLimits). Its id must be free: a second record under one
        id would leave the first unreachable, so that is refused (ValueError)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _admit(self) -> Request | None:
        if not self.waiting or len(self.running) >= self.max_num_seqs or not self.slots.num_free:
            return None
        req, cache, now = self.waiting[0], self.cache, self.step_no
        hit = cache.match(req.prompt_ids, req.num_prompt_tokens - 1, now) if cache else None
        if hit and not self._reserve(req, hit, now):
            # the room it needs is the cache's, maybe its own snapshot's: admit it as a miss if that fits
            hit = Match(hit.path[:1], None, 0)
            if not self._reserve(req, hit, now):
                return None  # head of line waits: admitting smaller requests past it could starve it forever
        elif not hit and not self._make_room(self.blocks.blocks_for(req.max_cached_tokens), now):
            return None
        shared = hit.position // self.blocks.block_size if hit else 0  # full blocks read from the cache
        need = self.blocks.blocks_for(req.max_cached_tokens) - shared
        self.waiting.popleft()
        req.state_slot = self.slots.allocate(1)[0]
        req.block_ids = [n.block for n in hit.path[1:shared + 1]] if hit else []
        req.block_ids += self.blocks.allocate(need)
        req.status = RequestStatus.RUNNING
        if hit:
            req.cache_path, req.num_shared_blocks = hit.path[:shared + 1], shared
            req.num_computed = hit.position
            if hit.position:
                cache.hits += 1
                cache.hit_tokens += hit.position
            snap = hit.snapshot
            if snap:
                cache.touch(snap, now)
                self._copies[0].append((snap.slot, req.state_slot))
                if snap.block is not None:  # the partial block: a copy of its own to write on into
                    self._copies[1].append((snap.block, req.block_ids[shared]))
            req.snapshots = self._snapshot_positions(req, hit)
        self.running.append(req)
        self._prefilling.append(req)  # (at least one prompt token is left to feed: a hit stops short of the end)
        req.admission_no = self._admissions
        self._admissions += 1
        return req

    def _reserve(self, req: Request, hit: Match, now: int) -> bool:
        """Hold the chain a hit reads and make room for the rest of the request's blocks; the hit's snapshot is
        kept while this plan is built. False (nothing held) when the room cannot be made."""
        shared = hit.position // self.blocks.block_size
        snap = hit.snapshot
        touched = snap.touched_step if snap else None
        self.cache.hold(hit.path[shared])
        if snap:
            snap.touched_step = now
        if self._make_room(self.blocks.blocks_for(req.max_cached_tokens) - shared, now):
            return True
        self.cache.release(hit.path[shared])
        if snap:
            snap.touched_step = touched
        return False

    def _snapshot_positions(self, req: Request, hit: Match) -> list[tuple[int, bool]]:
        """Where the prefill of a request admitted with `hit` snapshots: (position, speculative), ascending."""
        last, h, want = req.num_prompt_tokens - 1, hit.position, {}
        if last > h:
            want[last] = False
        if not self.cache.stateless:
            branch = (len(hit.path) - 1) * self.blocks.block_size // self.chunk * self.chunk
            if branch > h:
                want[branch] = False
            if self.snapshot_interval:
                for p in range((h // self.snapshot_interval + 1) * self.snapshot_interval, last,
                               self.snapshot_interval):
                    want.setdefault(p, True)
        return sorted(want.items())

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def _make_room(self, num_blocks: int, now: int) -> bool:
        """Evict cache snapshots until `num_blocks` KV blocks are free; False if they cannot be."""
        while self.blocks.num_free < num_blocks and self.cache and self.cache.evict_one(now):
            pass
        return self.blocks.num_free >= num_blocks

    def _extend(self, req: Request, ids: list[int], upto: int) -> None:
        """Add the full blocks of ids[:upto] (written by steps queued so far) to the request's cached chain."""
        bs, path = self.blocks.block_size, req.cache_path
        while len(path) - 1 < upto // bs:
            k = len(path) - 1
            node = self.cache.extend(path[-1], tuple(ids[k * bs:(k + 1) * bs]), req.block_ids[k])
            if node is None:
                return
            self.cache.hold(node)  # the request's reference moves to the end of its chain
            self.cache.release(path[-1])
            path.append(node)

    def _is_cached(self, req: Request, k: int) -> bool:
        """Whether block k of the request's table belongs to the cache (shared, or handed over to it)."""
        path = req.cache_path
        return k + 1 < len(path) and path[k + 1].block == req.block_ids[k]

    def _snapshot(self, req: Request, ids: list[int], p: int, speculative: bool, now: int, copies,
                  checkpoint: tuple[list, int] | None = None, own_tail: bool = False):
        """Snapshot the state of `req` after ids[:p]: a checkpoint (the plan's list, the row) of the plan being built
        when `checkpoint` is given, else a copy of its slot in `copies`. The KV block holding the tail is copied after the forward
        (into `self._later`), or taken over from the request (`own_tail`, when it ends). Returns the snapshot."""
        depth, r = divmod(p, self.blocks.block_size)
        if depth >= len(req.cache_path):
            return None  # its chain stopped before p (a hash collision)
        node, tail = req.cache_path[depth], tuple(ids[depth * self.blocks.block_size:p])
        if tail in node.snapshots:
            return None  # taken already (by a request with the same tokens)
        slot = self.cache.take_slot(now)
        if slot is None:
            return None
        block = None
        if r and own_tail:
            block = req.block_ids[depth]
        elif r:
            if not self._make_room(1, now):
                self.cache.free_slots.append(slot)
                return None
            block = self.blocks.allocate(1)[0]
            self._later[1].append((req.block_ids[depth], block))
        if checkpoint is not None:
            checkpoint[0].append((checkpoint[1], p, slot))
        else:
            copies[0].append((req.state_slot, slot))
        # readable by the plan after the one that writes it; a copy written before any forward (after a reply, in
        # self._copies) already by the plan that carries it, whose hits are listed after it
        return self.cache.add(node, tail, slot, block, speculative, now, now if copies is self._copies else now + 1)

    def _snapshot_reply(self, req: Request) -> int | None:
        """A request that ended on a stop: snapshot it after every token it fed (the next plan copies its slot,
        after the step still in flight), its blocks joining the chain. Returns the block the snapshot took over."""
        n, ids = req.num_computed, req.prompt_ids + req.output_ids
        if len(ids) < n or req.is_prefilling:
            return None
        self._extend(req, ids, n)
        snap = self._snapshot(req, ids, n, False, self.step_no + 1, self._copies, own_tail=True)
        return snap.block if snap is not None else None

    # ---- one step ----------------------------------------------------------------------------------------------
    def verifies_next(self) -> bool:
        """Whether the next schedule() gives a verify step of the decode rows alone (the same rows as the step
        before, or fewer): what decides it in _speculate, checked before (no prefill to continue, nobody waiting)."""
        decode = self._decode
        return bool(self.speculation is not None and self._drafted and decode.reqs and not self._prefilling
                    and not self.waiting and not _stops_suppressed(decode.reqs, 0))

    def schedule(self, behind: bool = False) -> ScheduledStep:
        """The next step's plan; every token in it counts as computed from now on. `behind`: the runs of the verify
        step before are not taken yet (only when verifies_next(): the plan is a verify step, spec_behind set)."""
        if behind and not self.verifies_next():
            raise RuntimeError("a step planned behind a verify step's runs must be a verify step (verifies_next)")
        self.step_no += 1
        budget = self.max_num_batched_tokens
        decode = self._decode
        n = len(decode.reqs)
        if n:  # the decoding requests' rows, as the step before left them, moved on by one
            step = self._decode_rows(decode, shared=not self._prefilling and not self.waiting)
            budget -= n
        else:
            step = ScheduledStep(StepPlan())
        for req in list(self._prefilling) if self._prefilling else ():  # oldest first
            if budget <= 0:
                break
            budget -= self._add_chunk(step, req, budget, [])
        while budget > 0 and self.waiting:
            req = self._admit()
            if req is None:
                break
            step.admitted.append(req)
            budget -= self._add_chunk(step, req, budget, req.block_ids)
        if step.plan.num_seqs:  # copies travel with a plan that runs; the later ones with the plan after it
            step.plan.copy_states, step.plan.copy_blocks = self._copies
            self._copies, self._later = self._later, ([], [])
        if step.joining:
            decode.join(step.joining)
        # requests whose last token this step schedules leave the scheduler now (their tokens end them in update);
        # the decode rows are looked at only once one of them can be such
        sampled, batch_ends = step.sampled, n and decode.steps >= decode.ends_at
        if batch_ends or len(sampled) > n:
            ended = [r for r in (sampled if batch_ends else sampled[n:]) if r.num_scheduled == r.params.max_tokens]
            if ended:
                self.free(*ended)
        if batch_ends:
            decode.next_end()
        if self.speculation is not None:
            self._speculate(step, n)
            step.plan.spec_behind = int(behind)
        return step

    def _speculate(self, step: ScheduledStep, n: int) -> None:
        """The step's spec_k (a step of the n decode rows alone verifies up to the drafts the step before proposed)
        and draft_k (the policy's choice, when the step samples anything; the runner writes the MTP head's KV at
        every step's positions whatever draft_k is)."""
        plan = step.plan
        k = self._drafted if n and plan.num_seqs == n else 0
        # no draft position may need a suppressed id (a row near its max_tokens takes fewer drafts: the runner
        # accepts none past its blocks, update drops tokens past max_tokens)
        plan.spec_k = 0 if _stops_suppressed(step.rows, 1) else k
        # no drafts where the next step cannot verify them (a row's stop ids still suppressed there): a plain
        # pure-decode step that proposes runs eagerly, one that does not replays a decode graph
        blocked = _stops_suppressed(step.sampled, 0)
        plan.draft_k = self._drafted = self.speculation.next_k(len(self.running)) if step.sampled and not blocked \
            else 0

    @staticmethod
    def _decode_rows(decode: DecodeBatch, shared: bool) -> ScheduledStep:
        """A step of the rows _add_row would give every member of `decode`: its own lists when no row follows them
        (`shared`), else copies for the rows to be appended to."""
        reqs, k = decode.reqs, decode.steps
        # (k + p: the positions moved on by the steps taken, in one pass of C, no Python frame per row)
        start = list(map(k.__add__, decode.start))
        if decode.hints is None:
            decode.hints = sampling_hints(reqs)
        if shared:
            plan = StepPlan(decode.slots, decode.empty, start, decode.empty, decode.want)
            step = ScheduledStep(plan, reqs, reqs, num_decode=len(reqs), decode_hints=decode.hints)
        else:
            plan = StepPlan(decode.slots.copy(), decode.empty.copy(), start, decode.empty.copy(), decode.want.copy())
            step = ScheduledStep(plan, reqs.copy(), reqs.copy(), num_decode=len(reqs), decode_hints=decode.hints)
        decode.steps = k + 1  # every member's num_computed and num_scheduled one up
        return step

    def _add_chunk(self, step: ScheduledStep, req: Request, budget: int, table: list[int]) -> int:
        start = req.num_computed
        end = min(req.num_prompt_tokens, start + budget)
        for p, _ in req.snapshots:  # a row is cut where a checkpoint inside it could not be written
            if p >= end:
                break
            if not can_checkpoint(start, end - start, p, self.chunk):
                end = p
                break
        row = step.plan.num_seqs
        self._add_row(step, req, req.prompt_ids[start:end], table)
        step.num_prompt_tokens += end - start
        if end == req.num_prompt_tokens:  # its prefill ends with this row: from the next step on it decodes
            self._prefilling.remove(req)
            step.joining.append(req)
        if self.cache:
            self._extend(req, req.prompt_ids, end)
            # a checkpoint of this row, else (one token on a state: that row runs the decode op) a copy after it
            while req.snapshots and req.snapshots[0][0] <= end:
                p, speculative = req.snapshots.pop(0)
                on_kernels = can_checkpoint(start, end - start, p, self.chunk)
                self._snapshot(req, req.prompt_ids, p, speculative, self.step_no, self._later,
                               (step.plan.checkpoints, row) if on_kernels else None)
        return end - start

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

    # ---- a step's tokens: where requests end -----------------------------------------------------------------
    def update(self, rows: list[Request], tokens: list[int], followed: bool = False) -> list[RequestOutput]:
        """A step's sampled tokens reach their requests (`rows`: the requests of its logits rows, in order), and the
        one place a request ends: on a stop token once min_tokens completion tokens exist (the token is kept, its
        text is not), on a stop string in its text from then on (the string and what follows are cut), or with its
        max_tokens-th token. An ended request is freed here. Returns the step's outputs, in row order (a request that
        does not stream gives none until it ends), then those of requests whose own token handling raised: each of
        these fails alone (finish_reason "error").
        With speculation, `tokens` holds a run per row instead (a list: the step's accepted drafts and one more;
        _update_runs); `followed`: a verify step planned behind these runs is queued (module docstring)."""
        if tokens and isinstance(tokens[0], list):
            return self._update_runs(rows, tokens, followed)
        outputs, failed, dropped = [], [], 0
        add = outputs.append
        for req, token in zip(rows, tokens):
            if req.finish_reason is not None:  # ended while this step was queued (aborted, failed, stopped): dropped
                dropped += 1
                continue
            try:
                n = len(req.output_ids) + 1  # with this token
                if not (token in req.stop_set and n > req.min_tokens or req.stops or n >= req.max_tokens):
                    # most tokens: nothing ends, nothing is held back (no stop strings): append_token and
                    # take_output in one, written out here (a call per token costs the host more than the rest)
                    req.output_ids.append(token)
                    try:
                        text = req.token_texts[token] if token >= 0 else None
                    except IndexError:
                        text = None
                    if not text:
                        text = req.detokenize(token)
                    if text:
                        req.sent.append(text)
                    if req.stream:  # (every token before this one has gone out already)
                        req.sent_tokens = n
                        add(RequestOutput(req.request_id, text, [token], False, None, req.num_prompt, n, None))
                    continue
                self._take(req, token, n)
                out = req.take_output()
            except Exception as e:
                failed.append(self.fail(req, e))
                continue
            self._settle(req, out, outputs)
        self.completion_tokens += min(len(rows), len(tokens)) - dropped - len(failed)
        return outputs + failed if failed else outputs

    @staticmethod
    def _take(req: Request, token: int, n: int) -> None:
        """A token that may end its request (the n-th completion token, with it): a stop token once min_tokens
        completion tokens exist (kept, its text not), a stop string in the text from then on (cut), max_tokens."""
        if token in req.stop_set and n > req.min_tokens:
            req.append_token(token, text=False)
            req.finish("stop")
        else:
            req.append_token(token)
            if req.stops and req.cut_at_stop_string(n >= req.min_tokens):
                req.finish("stop", flush=False)
            elif n >= req.max_tokens:
                req.finish("length")

    def _settle(self, req: Request, out: RequestOutput | None, outputs: list[RequestOutput],
                reply: bool = True) -> None:
        """After a request took its tokens of a step: freed if they ended it (free's `reply`), its output (if any)
        added."""
        if req.finish_reason is not None:
            self.free(req, reply=reply)
            del self.requests[req.request_id]
        if out is not None:
            outputs.append(out)

    def _update_runs(self, rows: list[Request], runs: list[list[int]], followed: bool) -> list[RequestOutput]:
        """update() for a step with a run of tokens per row: the runs' extra tokens (past the one counted when the
        row was scheduled) first move the request's counts on (they were fed to its caches: accepted drafts), then
        each token is taken as update() takes one, in order, until one ends the request (the rest are dropped).
        `followed`: a request whose last token the queued step now schedules leaves the scheduler here, as schedule()
        lets one go (its tokens end it in the next update): it has no row in a later step, whose positions would run
        past its blocks."""
        decode, extra = self._decode, {}
        for req, run in zip(rows, runs):
            if len(run) > 1 and req.finish_reason is None and req.status is RequestStatus.RUNNING:
                extra[req] = len(run) - 1
                req.num_computed += len(run) - 1
                req.num_scheduled += len(run) - 1
        if extra:
            decode.start = [s + extra.get(r, 0) for s, r in zip(decode.start, decode.reqs)]
            if followed:
                done = [r for r in extra if r.num_scheduled >= r.params.max_tokens]
                if done:
                    self.free(*done, reply=False)
            decode.next_end()
        outputs, failed, taken = [], [], 0
        for req, run in zip(rows, runs):
            if req.finish_reason is not None:  # ended while this step was queued: dropped
                continue
            try:
                for token in run:
                    taken += 1
                    self._take(req, token, len(req.output_ids) + 1)
                    if req.finish_reason is not None:
                        break
                out = req.take_output()
            except Exception as e:
                failed.append(self.fail(req, e))
                continue
            self._settle(req, out, outputs, reply=not followed)
        self.completion_tokens += taken
        return outputs + failed

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request from outside (the caller went away), its resources freed at once; its final output
        (finish_reason "abort"), or None for an unknown or already ended id. A step already queued may still run its
        rows: their tokens are dropped (update)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.free(req)
        req.abort()
        return req.take_output()

    def fail(self, req: Request, error: Exception) -> RequestOutput:
        """End one request with an error of its own (what it brought broke its sampling or its output handling),
        never the step loop; its final output."""
        log.error("request %s failed: %s: %s", req.request_id, type(error).__name__, error)
        self.free(req)
        req.fail(error)
        self.requests.pop(req.request_id, None)
        return req.take_output()

    # ---- leaving ---------------------------------------------------------------------------------------------
    def free(self, *reqs: Request, reply: bool = True) -> None:
        """Take requests out of the scheduler wherever they are and return what they hold (nothing twice), one after
        the other. One that ended on a stop (finish_reason "stop") is first snapshotted after what it fed, for a
        resent conversation (`reply`: unless a queued step has moved its slot past that)."""
        running = [r for r in reqs if r.status is RequestStatus.RUNNING]
        if len(running) == 1:
            self.running.remove(running[0])
        elif running:
            gone = set(running)
            self.running = [r for r in self.running if r not in gone]
        prefilling = [r for r in running if r.is_prefilling]
        for req in prefilling:
            self._prefilling.remove(req)
        if len(prefilling) < len(running):
            self._decode.leave([r for r in running if r not in prefilling] if prefilling else running)
        slots, cache = [], self.cache
        for req in reqs:
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            elif req.status is RequestStatus.RUNNING:
                kept = self._snapshot_reply(req) if reply and cache and req.finish_reason == "stop" else None
                slots.append(req.state_slot)  # (admission alone takes slots: freed together, in this order)
                # its blocks but those of its cached chain (block k is the chain's node k + 1) and the one kept
                path = req.cache_path
                self.blocks.free([b for k, b in enumerate(req.block_ids)
                                  if b != kept and not (k + 1 < len(path) and path[k + 1].block == b)])
                if path:
                    cache.release(path[-1])
                req.state_slot, req.block_ids, req.cache_path, req.snapshots = None, [], [], []
            req.status = RequestStatus.RELEASED
        if slots:
            self.slots.free(slots)

    def drop_cache(self) -> None:
        """Evict every snapshot, between steps (their blocks go back to the pool with them). Copies still pending
        into them then write into freed ids, ahead of any later use of those ids: harmless."""
        if self.cache:
            self.cache.evict_all(self.step_no + 2)

    # ---- metrics -------------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


def _stops_suppressed(reqs: list[Request], scheduled: int) -> bool:
    """Whether a request's stop ids are still suppressed at a position it would sample (min_tokens not reached):
    `scheduled` of its counted tokens are the step's own."""
    return any(req.min_tokens and req.num_scheduled - scheduled < req.min_tokens for req in reqs)


def sampling_hints(rows: list[Request], first: int = 0) -> tuple[bool, bool, bool, list[tuple[int, Request]]]:
    """Over requests sampled from rows first, first + 1, ...: (every one greedy, any with top-k, any with top-p,
    the (row, request) of those with min_tokens), what the sampler's kernels for a step are chosen by. A request
    already ended (failed while being bound) is left out: its row's token is dropped."""
    greedy_only, any_top_k, any_top_p, with_min = True, False, False, []
    for i, req in enumerate(rows, first):
        if req.finish_reason is not None:
            continue
        p = req.params
        if not p.greedy:
            greedy_only = False
            any_top_k |= p.top_k > 0
            any_top_p |= p.top_p < 1.0
        if p.min_tokens:
            with_min.append((i, req))
    return greedy_only, any_top_k, any_top_p, with_min
