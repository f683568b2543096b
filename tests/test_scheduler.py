"""Scheduler unit tests on small pools, driven by a simulated model and engine.

The simulation keeps its own record of what each request has fed the model (independent of the scheduler's
bookkeeping) and of each slot's block table (as the runner keeps it), and checks every StepPlan against them:
right tokens at the right positions (a row without tokens feeds the token sampled for it last), budget respected,
decodes before prefill chunks, block tables set once at admission and covering every token fed, no slot or block
shared between requests. With `lag`, it takes a step's tokens only after scheduling the next one (the engine's
overlap), and may stop requests early as a stop token would.

It also runs each plan on a simulated device, in plan order: a state slot holds the tokens fed into it, a KV block
the token at each of its positions; copies, checkpoints and rows act on them as the runner's would. Every row must
find its slot holding exactly the tokens before its start and its table's blocks holding them: that is what makes
a prefix-cache hit right, whatever the scheduler shared, snapshotted, evicted or reused on the way.
"""
import random

import pytest

from qwen35.sampling_params import SamplingParams
from scheduler.plan import COMMANDS, StepPlan
from scheduler.pools import BlockPool, IdPool
from scheduler.request import Request, RequestLimits, RequestStatus
from scheduler.scheduler import Scheduler


def make(prompt_len, max_tokens, rid, base=0):
    return Request(rid, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


class Sim:
    def __init__(self, sched: Scheduler, lag: bool = False, stop_after: dict | None = None):
        self.s = sched
        self.lag = lag
        self.stop_after = stop_after or {}    # rid -> completion tokens after which a "stop token" ends it
        self.fed: dict[str, int] = {}        # tokens each request has fed the model
        self.seq: dict[str, list[int]] = {}  # prompt + tokens sampled by the "model" (on the device)
        self.slot: dict[str, int] = {}
        self.tables: dict[int, list[int]] = {}  # per state slot, as the runner keeps them
        self.live: dict[str, Request] = {}   # unfinished requests
        self.ended_at: dict[str, int] = {}   # rid -> the step whose tokens ended it
        self.pending = None                  # (step number, scheduled step) whose tokens are not taken yet
        self.plans = []
        self.max_running = 0
        self.step_no = 0
        self.owners_before: dict = {}         # the prefix cache's blocks after the step before: block -> owner
        self.state: dict[int, list[int]] = {}   # the simulated device: tokens fed into each state slot
        self.kv: dict[int, list] = {}           # the token written at each position of each KV block

    def add(self, req):
        self.s.add(req)
        self.live[req.request_id] = req
        self.fed[req.request_id] = 0
        self.seq[req.request_id] = list(req.prompt_ids)
        self.slot.pop(req.request_id, None)

    def step(self):
        step = self.s.schedule()
        plan = step.plan
        self.plans.append(plan)
        self.step_no += 1
        self.check(plan, step)
        self.execute(plan, step)
        for req, n in zip(step.rows, plan.seq_lens):
            self.fed[req.request_id] += n
        for i, req in enumerate(step.sampled):  # the "device" samples at once; the host takes them later
            self.seq[req.request_id].append(10_000 + 100 * self.step_no + i)
        done = (self.step_no, step)
        if self.lag:
            done, self.pending = self.pending, done
        if done is not None:
            self.postprocess(*done)
        self.max_running = max(self.max_running, self.s.num_running)
        return plan, step

    def postprocess(self, step_no, step):
        for req in step.sampled:
            if req.is_finished:  # ended by the step before: this row was queued already, its token goes nowhere
                assert self.lag and self.ended_at[req.request_id] == step_no - 1, "a finished request got a row"
                continue
            req.output_ids.append(self.seq[req.request_id][req.num_prompt_tokens + len(req.output_ids)])
            n = len(req.output_ids)
            if n >= req.params.max_tokens or n == self.stop_after.get(req.request_id):
                req.finish_reason = "length" if n >= req.params.max_tokens else "stop"
                self.s.free(req)  # (what Scheduler.update does with a request that ends)
                del self.s.requests[req.request_id]
                self.ended_at[req.request_id] = step_no
                del self.live[req.request_id]

    def check(self, plan, step):
        s = self.s
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert plan.num_seqs == len(step.rows) <= s.max_num_seqs
        assert len(set(plan.state_slots)) == plan.num_seqs, "two sequences share a state slot"
        decode = [not t for t in plan.token_ids]
        assert decode == sorted(decode, reverse=True), "decodes must come before prefill chunks"
        for i, req in enumerate(step.rows):
            rid = req.request_id
            start, toks = plan.start_pos[i], plan.token_ids[i]
            if rid not in self.slot and (start, plan.state_slots[i]) in self._hits(plan):
                self.fed[rid] = start  # a prefix-cache hit: its state and KV start as the cached prompt's
            assert start == self.fed[rid]
            if toks:
                assert toks == self.seq[rid][start:start + len(toks)]
            else:  # fed from the device: the token sampled for this request last
                assert start == len(self.seq[rid]) - 1 and start >= req.num_prompt_tokens
            end = start + plan.seq_lens[i]
            # a request keeps its slot for its whole life; its block table is set once, when it is admitted
            first = rid not in self.slot
            assert self.slot.setdefault(rid, plan.state_slots[i]) == plan.state_slots[i]
            assert bool(plan.block_tables[i]) == first
            if first:
                self.tables[plan.state_slots[i]] = plan.block_tables[i]
                assert len(plan.block_tables[i]) == s.blocks.blocks_for(req.max_cached_tokens)
            assert len(self.tables[plan.state_slots[i]]) * s.blocks.block_size >= end
            # the logits row is wanted exactly when the sequence ends at its newest token
            assert plan.want_logits[i] == (end == len(self.seq[rid]))
        assert [r for r, w in zip(step.rows, plan.want_logits) if w] == step.sampled
        running_blocks = [b for r in s.running for k, b in enumerate(r.block_ids) if not s._is_cached(r, k)]
        assert len(running_blocks) == len(set(running_blocks)), "a KV block is held by two requests"
        running_slots = [r.state_slot for r in s.running]
        assert len(running_slots) == len(set(running_slots))
        cached = cache_blocks(s)
        assert not set(cached) & set(running_blocks), "a request writes into a block of the prefix cache"
        assert len(cached) == len(set(cached)) == (s.cache.num_blocks if s.cache else 0)
        bs, owners = s.blocks.block_size, cache_owners(s)
        for i, req in enumerate(step.rows):  # a row never writes into a block that a cache owner keeps
            first, last = plan.start_pos[i] // bs, (plan.start_pos[i] + plan.seq_lens[i] - 1) // bs
            for b in self.tables[plan.state_slots[i]][first:last + 1]:
                assert b not in self.owners_before or self.owners_before[b] is not owners.get(b), \
                    "a row writes into a block of the prefix cache"
        self.owners_before = owners
        assert s.slots.num_used == len(s.running) and s.blocks.num_used == len(running_blocks) + len(cached)
        dsts = [dst for _, _, dst in plan.checkpoints]  # (copies run in order, before the forward)
        assert len(dsts) == len(set(dsts)), "two checkpoints into one snapshot slot (one launch: no defined order)"
        for row, pos, dst in plan.checkpoints:  # where the DeltaNet prefill kernels can stop (qwen35/runner.py)
            start, n = plan.start_pos[row], plan.seq_lens[row]
            assert (n > 1 or start == 0) and start < pos <= start + n
            assert (pos - start) % s.chunk == 0 or pos == start + n

    def execute(self, plan, step):
        """The plan on the simulated device: copies in order, then each row reads its slot and blocks (which must
        hold its tokens before `start`), leaves its checkpoints and writes its new tokens."""
        bs = self.s.blocks.block_size
        for src, dst in plan.copy_states:
            self.state[dst] = list(self.state.get(src, ["?"]))
        for src, dst in plan.copy_blocks:
            self.kv[dst] = list(self.kv.get(src, ["?"] * bs))
        for i, req in enumerate(step.rows):
            rid, slot, start, n = req.request_id, plan.state_slots[i], plan.start_pos[i], plan.seq_lens[i]
            seq, table = self.seq[rid], self.tables[slot]
            assert (self.state.get(slot) if start else []) == seq[:start], f"{rid}: slot {slot} at {start}"
            assert [self.kv[table[p // bs]][p % bs] for p in range(start)] == seq[:start], f"{rid}: KV before {start}"
            for row, pos, dst in plan.checkpoints:
                if row == i:
                    self.state[dst] = seq[:pos]
            self.state[slot] = seq[:start + n]
            for p in range(start, start + n):
                self.kv.setdefault(table[p // bs], ["?"] * bs)[p % bs] = seq[p]

    def _hits(self, plan):
        """(prefix length, slot) of the cache hits this plan admits: a snapshot copied into the slot."""
        snaps = {sn.slot: sn.position for sn in snapshots(self.s)}
        return {(snaps[src], dst) for src, dst in plan.copy_states if src in snaps}

    def run(self, max_steps=1000):
        while self.live:
            self.step()
            assert self.step_no < max_steps, "scheduler made no progress"
        if self.pending is not None:  # its rows all belong to requests already ended
            self.postprocess(*self.pending)
            self.pending = None


def snapshots(s: Scheduler):
    if not s.cache:
        return []
    return [sn for node in [s.cache.root, *s.cache.nodes.values()] for sn in node.snapshots.values()]


def cache_blocks(s: Scheduler) -> list[int]:
    """Every KV block the prefix cache owns: its chain's and its snapshots' partial blocks."""
    if not s.cache:
        return []
    return [n.block for n in s.cache.nodes.values()] + [sn.block for sn in snapshots(s) if sn.block is not None]


def cache_owners(s: Scheduler) -> dict:
    """block -> the node or snapshot of the prefix cache that owns it."""
    if not s.cache:
        return {}
    return {n.block: n for n in s.cache.nodes.values()} | {sn.block: sn for sn in snapshots(s) if sn.block is not None}


def assert_pools_full(s: Scheduler):
    assert s.blocks.num_free == s.blocks.size and s.blocks.num_used == 0
    assert s.slots.num_free == s.slots.size and s.slots.num_used == 0
    assert not s.running and not s.waiting and not s.has_work()


def test_budget_decodes_first_and_chunking():
    s = Scheduler(num_kv_blocks=64, block_size=4, num_state_slots=4, max_num_seqs=4, max_num_batched_tokens=8)
    sim = Sim(s)
    a, b = make(20, 3, "a"), make(3, 3, "b", base=500)
    sim.add(a)
    sim.add(b)
    p1, _ = sim.step()  # a's first chunk fills the whole budget: b must wait
    assert p1.token_ids == [list(range(0, 8))] and p1.start_pos == [0] and p1.want_logits == [False]
    assert b.status is RequestStatus.WAITING
    p2, _ = sim.step()
    assert p2.token_ids == [list(range(8, 16))] and p2.start_pos == [8] and p2.want_logits == [False]
    p3, _ = sim.step()  # a's last chunk (4 tokens) + b's whole prompt (3) fit the budget of 8
    assert p3.token_ids == [[16, 17, 18, 19], [500, 501, 502]]
    assert p3.start_pos == [16, 0] and p3.want_logits == [True, True]
    p4, _ = sim.step()  # both decode, each the token sampled for it last (on the device: no host tokens)
    assert p4.start_pos == [20, 3] and p4.token_ids == [[], []] and p4.seq_lens == [1, 1] and p4.is_pure_decode
    c = make(30, 2, "c", base=900)
    sim.add(c)
    p5, _ = sim.step()  # decodes first, then c's chunk gets the 6 tokens left
    assert p5.start_pos == [21, 4, 0] and p5.seq_lens == [1, 1, 6]
    assert p5.want_logits == [True, True, False]
    sim.run()
    assert a.output_ids and len(a.output_ids) == 3 and len(c.output_ids) == 2
    assert all(p.num_tokens <= 8 for p in sim.plans)
    assert_pools_full(s)


@pytest.mark.parametrize("lag", [False, True])
def test_many_requests_random_sizes_complete(lag):
    # lag: each step's tokens are taken after the next step is scheduled (the engine's overlap), and a third of the
    # requests end early as on a stop token, so that a row of theirs is already queued when they end
    rng = random.Random(0)
    s = Scheduler(num_kv_blocks=40, block_size=4, num_state_slots=3, max_num_seqs=3, max_num_batched_tokens=16)
    reqs = [make(rng.randint(1, 40), rng.randint(1, 12), f"r{i}", base=1000 * i) for i in range(30)]
    stops = {r.request_id: rng.randint(1, r.params.max_tokens) for r in reqs[::3]}
    sim = Sim(s, lag=lag, stop_after=stops)
    for i, r in enumerate(reqs):
        sim.add(r)
        if i % 3 == 0:
            sim.step()  # requests keep arriving while others run
    sim.run()
    for r in reqs:
        n = stops.get(r.request_id, r.params.max_tokens)
        assert r.status is RequestStatus.RELEASED and len(r.output_ids) == n, r.request_id
        assert r.finish_reason == ("length" if n == r.params.max_tokens else "stop")
    assert sim.max_running <= 3
    # with lag, a request ending early had exactly one more row queued (its token dropped); without, none
    early = sum(n < r.params.max_tokens for r in reqs for n in [stops.get(r.request_id, r.params.max_tokens)])
    assert early > 3
    assert sum(r.num_scheduled - len(r.output_ids) for r in reqs) == (early if lag else 0)
    assert_pools_full(s)


def test_admission_waits_for_kv_blocks():
    # 4 blocks of 4 tokens; each request needs prompt 5 + 4 new - 1 = 8 cached tokens = 2 blocks: 2 fit at a time
    s = Scheduler(num_kv_blocks=4, block_size=4, num_state_slots=8, max_num_seqs=8, max_num_batched_tokens=64)
    sim = Sim(s)
    reqs = [make(5, 4, f"r{i}", base=100 * i) for i in range(5)]
    for r in reqs:
        sim.add(r)
    sim.step()
    assert s.num_running == 2 and s.num_waiting == 3 and s.blocks.num_free == 0
    sim.run()
    assert sim.max_running == 2
    assert all(len(r.output_ids) == 4 for r in reqs)
    assert_pools_full(s)


def test_admission_waits_for_state_slots():
    s = Scheduler(num_kv_blocks=100, block_size=4, num_state_slots=2, max_num_seqs=8, max_num_batched_tokens=64)
    assert s.max_num_seqs == 2  # one slot per running sequence
    sim = Sim(s)
    reqs = [make(3 + i, 5, f"r{i}", base=100 * i) for i in range(6)]
    for r in reqs:
        sim.add(r)
    sim.run()
    assert sim.max_running == 2
    assert all(len(r.output_ids) == 5 for r in reqs)
    assert_pools_full(s)


def test_head_of_line_request_is_not_starved():
    # a big request first in line is admitted before smaller ones that arrived after it
    s = Scheduler(num_kv_blocks=6, block_size=4, num_state_slots=4, max_num_seqs=4, max_num_batched_tokens=64)
    sim = Sim(s)
    small0 = make(4, 5, "small0")              # 8 tokens -> 2 blocks
    big = make(16, 5, "big", base=100)         # 20 tokens -> 5 blocks: must wait for small0
    small1 = make(4, 5, "small1", base=200)    # would fit next to small0, but big is first in line
    for r in (small0, big, small1):
        sim.add(r)
    sim.step()
    assert small0.status is RequestStatus.RUNNING and big.status is small1.status is RequestStatus.WAITING
    while small0.status is RequestStatus.RUNNING:
        sim.step()
    sim.step()
    assert big.status is RequestStatus.RUNNING and small1.status is RequestStatus.WAITING
    sim.run()
    assert_pools_full(s)


def test_abort_frees_everything():
    s = Scheduler(num_kv_blocks=20, block_size=4, num_state_slots=2, max_num_seqs=2, max_num_batched_tokens=10)
    sim = Sim(s)
    decoding = make(3, 30, "decoding")
    prefilling = make(30, 5, "prefilling", base=100)
    waiting = make(3, 5, "waiting", base=200)
    for r in (decoding, prefilling, waiting):
        sim.add(r)
    sim.step()
    sim.step()
    assert decoding.output_ids and not decoding.is_finished
    assert prefilling.status is RequestStatus.RUNNING and prefilling.is_prefilling
    assert waiting.status is RequestStatus.WAITING  # no state slot left
    assert s.blocks.num_used == 8 + 9 and s.slots.num_free == 0
    for r in (waiting, prefilling, decoding):
        assert s.abort(r.request_id).finish_reason == "abort"
        del sim.live[r.request_id]
        assert r.status is RequestStatus.RELEASED and r.finish_reason == "abort"
    assert s.abort("decoding") is None and not s.requests  # ended: unknown from then on
    s.free(decoding)  # a second free returns nothing twice
    assert_pools_full(s)
    step = s.schedule()
    assert step.plan.num_seqs == 0 and not step.rows and not step.sampled
    again = make(3, 2, "decoding")  # the id is free again
    sim.add(again)
    sim.run()
    assert len(again.output_ids) == 2
    assert_pools_full(s)


def test_last_token_scheduled_frees_capacity_at_once():
    # one slot: a request's slot is free for the next schedule as soon as its last token is scheduled, before
    # that token has reached the host (the step that writes into the slot is queued ahead of any step reusing it)
    s = Scheduler(num_kv_blocks=8, block_size=4, num_state_slots=1, max_num_seqs=1, max_num_batched_tokens=8)
    a, b = make(3, 2, "a"), make(3, 2, "b", base=100)
    s.add(a)
    s.add(b)
    first = s.schedule()  # a's prompt, first token
    second = s.schedule()  # a's decode, its last token: a leaves the scheduler
    assert [r.request_id for r in first.sampled + second.sampled] == ["a", "a"]
    assert a.status is RequestStatus.RELEASED and a.state_slot is None and s.slots.num_free == 1
    third = s.schedule()  # b takes the slot a had, with a fresh block table
    assert third.admitted == [b] and third.plan.state_slots == second.plan.state_slots
    assert third.plan.start_pos == [0] and third.plan.block_tables[0]


def test_request_that_never_fits_is_rejected():
    # checked where requests come in (the server, the offline LLM): the scheduler trusts what it is given
    limits = RequestLimits(vocab_size=1000, max_model_len=64, num_kv_blocks=4, block_size=4)
    limits.check(list(range(10)), SamplingParams(max_tokens=7))  # 16 cached tokens: exactly the whole cache
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(8\).*5 KV blocks.*only 4 blocks"):
        limits.check(list(range(10)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="at least one token"):
        limits.check([], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(64\)"):
        RequestLimits(1000, 64, 100, 4).check(list(range(60)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1000\)"):
        limits.check([1000], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        limits.check([1], SamplingParams(max_tokens=1, stop_token_ids=[1000]))
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        limits.check([1], {"max_tokens": 1})


def test_budget_must_hold_a_decode_batch():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(num_kv_blocks=8, block_size=4, num_state_slots=8, max_num_seqs=8, max_num_batched_tokens=4)


def test_pools_refuse_double_free_and_overdraw():
    p = IdPool(2, "x")
    a = p.allocate(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        p.allocate(1)
    p.free(a)
    with pytest.raises(RuntimeError, match="not allocated"):
        p.free([a[0]])
    assert BlockPool(4, 16).blocks_for(17) == 2 and BlockPool(4, 16).blocks_for(16) == 1


# ---- the prefix cache, on the simulated device ------------------------------------------------------------------
def cached(**kw) -> Scheduler:
    """Blocks of 4 tokens, a DeltaNet chunk of 8, snapshots every 16 tokens, 3 snapshot slots."""
    kw = {"num_kv_blocks": 60, "block_size": 4, "num_state_slots": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 64, "snapshot_slots": [4, 5, 6], "snapshot_interval": 16, "chunk": 8, **kw}
    return Scheduler(**kw)


def finish(sim: Sim, req: Request) -> Request:
    sim.add(req)
    while req.request_id in sim.live:
        sim.step()
        assert sim.step_no < 1000, "scheduler made no progress"
    return req


def test_prefix_cache_hits_where_it_should():
    s = cached(snapshot_slots=list(range(4, 12)))
    sim = Sim(s, stop_after={"a": 2})
    shared = list(range(500, 530))                   # 30 tokens: 7 full blocks
    hit = lambda: s.cache.hit_tokens
    a = finish(sim, Request("a", shared + list(range(10)), SamplingParams(max_tokens=4)))
    # every 16 tokens, after all but its last prompt token, and after the reply it stopped (prompt + 1 token fed)
    assert hit() == 0 and sorted(sn.position for sn in snapshots(s)) == [16, 32, 39, 41]
    finish(sim, Request("b", shared + list(range(100, 112)), SamplingParams(max_tokens=2)))
    assert hit() == 16  # its chain leaves a's at 30 (28 in full blocks): the interval snapshot at 16 serves
    assert 24 in [sn.position for sn in snapshots(s)]  # where it left a's chain, rounded down to the chunk
    finish(sim, Request("c", shared + list(range(200, 205)), SamplingParams(max_tokens=2)))
    assert hit() == 16 + 24
    finish(sim, Request("d", list(a.prompt_ids), SamplingParams(max_tokens=2)))
    assert hit() == 16 + 24 + 39  # the same prompt: all but its last token
    # a's reply ended on a stop: the next turn (prompt, reply, more) resumes after the 41 tokens a fed
    assert len(a.output_ids) == 2 and a.finish_reason == "stop"
    finish(sim, Request("e", a.prompt_ids + a.output_ids + [7, 8, 9], SamplingParams(max_tokens=2)))
    assert hit() == 16 + 24 + 39 + 41 and s.cache.hits == 4
    s.drop_cache()
    assert_pools_full(s)


def test_snapshots_of_the_plan_being_built_are_not_evicted():
    """One snapshot slot and a row that passes three snapshot positions: the first takes the slot and the others
    find none (evicting it would put two checkpoints into one slot in one launch, in no defined order); the plan
    after, another request may take it."""
    s = cached(snapshot_slots=[4], max_num_batched_tokens=64)
    sim = Sim(s)
    sim.add(Request("a", list(range(40)), SamplingParams(max_tokens=2)))
    plan, _ = sim.step()
    assert plan.checkpoints == [(0, 16, 4)] and [sn.position for sn in snapshots(s)] == [16]
    sim.run()
    finish(sim, Request("b", list(range(100, 120)), SamplingParams(max_tokens=2)))  # evicts a's to take the slot
    assert [sn.position for sn in snapshots(s)] == [16] and snapshots(s)[0].node.tokens[0] == 112


def test_a_hit_that_needs_its_own_snapshots_room_runs_as_a_miss():
    """A pool of 5 blocks; the cache holds a's prompt (2 full blocks and a partial one after its end snapshot). b
    extends that prompt and needs all 5 blocks: as a hit it would keep the 2 full blocks but need 3 more, and only
    its own snapshot's partial block could give the third. It is admitted as a miss instead of waiting forever."""
    s = cached(num_kv_blocks=5, max_num_batched_tokens=32)
    sim = Sim(s)
    a = finish(sim, Request("a", list(range(10)), SamplingParams(max_tokens=2)))
    assert [sn.position for sn in snapshots(s)] == [9] and s.blocks.num_free == 2
    b = finish(sim, Request("b", a.prompt_ids + list(range(50, 57)), SamplingParams(max_tokens=4)))
    assert len(b.output_ids) == 4 and s.cache.hits == 0
    s.drop_cache()
    assert_pools_full(s)


@pytest.mark.parametrize("lag", [False, True])
def test_prefix_cache_random_workload(lag):
    """Few-shot prompts over shared prefixes, repeats and resent conversations arriving over time, some ending on a
    stop, with small random budgets (rows cut across snapshot positions), 3 snapshot slots and a KV pool that makes
    admission take the cache's blocks back, while requests in flight read shared ones: every row on the simulated
    device finds exactly its prefix in its slot and its blocks. Dropping the cache at the end frees everything."""
    rng = random.Random(lag)
    s = cached(max_num_batched_tokens=rng.choice([9, 17, 40]))
    stops = {}
    sim = Sim(s, lag=lag, stop_after=stops)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    reqs = []
    for i in range(80):
        ended = [r for r in reqs if r.finish_reason in ("stop", "length")]
        kind = rng.random()
        if kind < 0.2 and ended:
            prompt = list(rng.choice(ended).prompt_ids)
        elif kind < 0.4 and ended:
            r = rng.choice(ended)
            prompt = r.prompt_ids + r.output_ids + [rng.randrange(1000) for _ in range(rng.randint(1, 5))]
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        if len(prompt) > 60:
            prompt = prompt[:rng.randint(1, 60)]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 6)))
        if rng.random() < 0.4:
            stops[req.request_id] = rng.randint(1, req.params.max_tokens)
        reqs.append(req)
        sim.add(req)
        for _ in range(rng.randint(0, 3)):
            sim.step()
    s.max_num_batched_tokens = 13  # and smaller cuts from here on
    sim.run()
    assert s.cache.hits >= 15 and s.cache.hit_tokens >= 300  # of ~2,000-2,600 prompt tokens, under pressure
    assert any(p.checkpoints for p in sim.plans) and any(p.copy_blocks for p in sim.plans)
    s.drop_cache()
    assert_pools_full(s)


def random_plan(rng: random.Random) -> StepPlan:
    rows = rng.choice([0, 1, 3, 64, 300])
    big = 2**62  # every value of an int64 field travels exactly, ids and positions far past any real one
    return StepPlan(
        state_slots=[rng.randrange(big) for _ in range(rows)],
        token_ids=[[rng.randrange(big) for _ in range(rng.choice([0, 0, 1, rng.randrange(1, 600)]))]
                   for _ in range(rows)],
        start_pos=[rng.randrange(big) for _ in range(rows)],
        block_tables=[[rng.randrange(big) for _ in range(rng.choice([0, 0, rng.randrange(1, 100)]))]
                      for _ in range(rows)],
        want_logits=[rng.random() < 0.5 for _ in range(rows)],
        copy_states=[(rng.randrange(big), rng.randrange(big)) for _ in range(rng.choice([0, 0, 5]))],
        copy_blocks=[(rng.randrange(big), rng.randrange(big)) for _ in range(rng.choice([0, 0, 5]))],
        command=rng.choice(COMMANDS))


def test_plan_encoding_round_trip_is_exact():
    rng = random.Random(0)
    for _ in range(300):
        plan = random_plan(rng)
        packed = plan.encode()
        assert all(type(x) is int for x in packed)
        assert StepPlan.decode(packed) == plan
    # what the scheduler sends, prefix-cache copies included
    s = Scheduler(num_kv_blocks=64, block_size=4, num_state_slots=4, max_num_seqs=4, max_num_batched_tokens=16,
                  snapshot_slots=[4, 5])
    sim = Sim(s)
    for i in range(3):
        sim.add(make(10, 4, f"same{i}", base=0))  # the same prompt: later ones hit the cache entry of the first
    while sim.live:
        plan, _ = sim.step()
        assert StepPlan.decode(plan.encode()) == plan
    assert any(p.copy_states for p in sim.plans) and any(p.copy_blocks for p in sim.plans)
    assert s.cache.hits >= 1


def test_plan_decoding_refuses_what_is_not_a_plan():
    packed = StepPlan([1], [[5, 6]], [0], [[3]], [True]).encode()
    for bad in (packed[:-1], packed + packed[:1], [99, 0, 0, 0, 0, 0, 0], [99, 0, 0, 0, 0, 0, 0, 0]):
        with pytest.raises(ValueError, match="not a step plan"):
            StepPlan.decode(bad)


# ---- speculative decoding: a verify step planned behind the runs of the one before ----------------------------
class _NoText:
    pending = False

    def add(self, token_id):
        return ""

    def flush(self):
        return ""


def _two_verify_steps(b_max_tokens=20):
    """A cached scheduler with k = 2 and two requests (a stops on token 99) after their prefill: a verify step, and
    the next one planned behind its runs."""
    from scheduler.speculation import SpecPolicy
    s = cached(speculation=SpecPolicy(2))
    a = Request("a", list(range(100, 110)), SamplingParams(max_tokens=20, stop_token_ids=[99]), detokenizer=_NoText())
    b = Request("b", list(range(200, 210)), SamplingParams(max_tokens=b_max_tokens), detokenizer=_NoText())
    s.add(a)
    s.add(b)
    for _ in range(3):  # both prefills (cut at a snapshot), one token each, drafts proposed
        step = s.schedule()
        s.update(step.sampled, [5 if r is a else 6 for r in step.sampled])
        if s.verifies_next():
            break
    second = s.schedule()
    assert second.plan.spec_k == 2 and not second.plan.spec_behind
    assert s.verifies_next()
    third = s.schedule(behind=True)
    assert third.plan.spec_k == 2 and third.plan.spec_behind == 1
    assert third.plan.state_slots == second.plan.state_slots
    assert third.plan.start_pos == [p + 1 for p in second.plan.start_pos]  # (the runs' extra tokens not known yet)
    return s, a, b, second, third


@pytest.mark.parametrize("followed", [False, True])
def test_verify_step_planned_behind(followed):
    """A request whose run ends on a stop while a verify step planned behind that run is queued (update(...,
    followed=True)) is freed without a reply snapshot: the queued step has moved its slot past the reply (with
    followed=False, as when the engine takes the runs first, the snapshot is taken). The runs then move the host's
    positions on; the queued step's row of the ended request is dropped. Nothing but a verify step is planned
    behind: with a request waiting, verifies_next() is False and schedule(behind=True) refuses."""
    s, a, b, second, third = _two_verify_steps()
    before = len(snapshots(s))
    s.update(second.sampled, [[7, 8, 99], [7, 8, 9]], followed=followed)  # a stops on its run's last token
    assert a.finish_reason == "stop" and a.output_ids == [5, 7, 8, 99]
    assert len(snapshots(s)) == before + (0 if followed else 1)
    s.update(third.sampled, [[1, 2, 3], [4, 5, 6]])
    assert b.output_ids == [6, 7, 8, 9, 4, 5, 6] and a.output_ids == [5, 7, 8, 99]
    assert s.schedule().plan.start_pos == [10 + 6]  # b: prompt and every token but the newest fed
    s.add(Request("c", [1, 2, 3], SamplingParams(max_tokens=2), detokenizer=_NoText()))
    assert not s.verifies_next()
    with pytest.raises(RuntimeError, match="verify step"):
        s.schedule(behind=True)


def test_a_run_that_schedules_the_last_token_of_a_request_ends_its_rows():
    """Planned behind: b (max_tokens 5) has 1 token, its verify step in flight accepts both drafts (3 tokens), and the
    step queued behind it holds b's 5th token. Taking the runs lets b go at once (no row of b in any later plan, whose
    positions would run past its blocks: the server crashed on that at a block boundary, 2026-11-29); the queued
    step's first token then ends it."""
    s, a, b, second, third = _two_verify_steps(b_max_tokens=5)
    s.update(second.sampled, [[7, 8], [7, 8, 9]], followed=True)
    assert b.num_scheduled == 5 and b not in s.running and b.finish_reason is None
    nxt = s.schedule(behind=True)
    assert nxt.plan.state_slots == [a.state_slot] and nxt.plan.spec_behind
    s.update(third.sampled, [[1, 2, 3], [4, 5, 6]], followed=True)
    assert b.finish_reason == "length" and b.output_ids == [6, 7, 8, 9, 4] and "b" not in s.requests


@pytest.mark.parametrize("setting", [2, 0])
def test_prompt_chunks_that_sample_nothing_draft_nothing(setting):
    """A step of prompt chunks that samples nothing (the body before the snapshot's cut) has draft_k 0 (the runner
    writes the MTP head's KV there anyway, tests/test_spec_runner.py), so the next step verifies nothing; the
    prompt's last token then proposes the policy's k. Off: draft_k 0 throughout."""
    from scheduler.speculation import SpecPolicy
    s = cached(speculation=SpecPolicy(setting))
    s.add(Request("a", list(range(100, 110)), SamplingParams(max_tokens=20), detokenizer=_NoText()))
    body = s.schedule()
    assert not body.sampled and not body.plan.is_pure_decode
    assert (body.plan.spec_k, body.plan.draft_k) == (0, 0)
    assert not s.verifies_next()
    s.update(body.sampled, [])
    last = s.schedule()
    assert len(last.sampled) == 1 and (last.plan.spec_k, last.plan.draft_k) == (0, setting)
