"""Scheduler unit tests on small pools, driven by a simulated model.

The simulation keeps its own record of what each request has fed the model (independent of the scheduler's
bookkeeping) and checks every StepPlan against it: right tokens at the right positions, budget respected, decodes
before prefill chunks, block tables covering exactly the tokens so far, no slot or block shared between requests.
"""
import pytest

from qwen35.sampling_params import SamplingParams
from scheduler.pools import BlockPool, IdPool
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler


def make(prompt_len, max_tokens, rid, base=0):
    return Request(rid, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


class Sim:
    def __init__(self, sched: Scheduler):
        self.s = sched
        self.fed: dict[str, int] = {}        # tokens each request has fed the model
        self.seq: dict[str, list[int]] = {}  # prompt + tokens sampled by the "model"
        self.slot: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.plans = []
        self.max_running = 0
        self.step_no = 0

    def add(self, req):
        self.s.add(req)
        self.fed[req.request_id] = 0
        self.seq[req.request_id] = list(req.prompt_ids)
        self.slot.pop(req.request_id, None)
        self.blocks.pop(req.request_id, None)

    def step(self):
        plan, seqs = self.s.schedule()
        self.plans.append(plan)
        self.step_no += 1
        self.check(plan, seqs)
        want = [s for s in seqs if s.want_logits]
        sampled = [10_000 + 100 * self.step_no + i for i in range(len(want))]
        for s, tok in zip(want, sampled):
            self.seq[s.request.request_id].append(tok)
        for s in seqs:
            self.fed[s.request.request_id] += s.num_tokens
        for req in self.s.update(seqs, sampled):
            if len(req.output_ids) >= req.params.max_tokens:
                self.s.finish(req, "length")
        self.max_running = max(self.max_running, self.s.num_running)
        return plan, seqs

    def check(self, plan, seqs):
        s = self.s
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert plan.num_seqs == len(seqs) <= s.max_num_seqs
        assert len(set(plan.state_slots)) == plan.num_seqs, "two sequences share a state slot"
        decode = [len(t) == 1 and p > 0 and len(self.seq[q.request.request_id]) > q.request.num_prompt_tokens
                  for t, p, q in zip(plan.token_ids, plan.start_pos, seqs)]
        assert decode == sorted(decode, reverse=True), "decodes must come before prefill chunks"
        for i, sq in enumerate(seqs):
            rid = sq.request.request_id
            start, toks = plan.start_pos[i], plan.token_ids[i]
            assert start == self.fed[rid]
            assert toks == self.seq[rid][start:start + len(toks)]
            end = start + len(toks)
            assert len(plan.block_tables[i]) == -(-end // s.blocks.block_size)
            # a request keeps its slot and its blocks for its whole life
            assert self.slot.setdefault(rid, plan.state_slots[i]) == plan.state_slots[i]
            known = self.blocks.setdefault(rid, plan.block_tables[i])
            n = min(len(known), len(plan.block_tables[i]))
            assert known[:n] == plan.block_tables[i][:n]
            if len(plan.block_tables[i]) > len(known):
                self.blocks[rid] = plan.block_tables[i]
            # the logits row is wanted exactly when the sequence ends at its newest token
            assert plan.want_logits[i] == (end == len(self.seq[rid]))
        running_blocks = [b for r in s.running for b in r.block_ids]
        assert len(running_blocks) == len(set(running_blocks)), "a KV block is held by two requests"
        running_slots = [r.state_slot for r in s.running]
        assert len(running_slots) == len(set(running_slots))

    def run(self, max_steps=1000):
        while self.s.has_unfinished():
            self.step()
            assert self.step_no < max_steps, "scheduler made no progress"


def assert_pools_full(s: Scheduler):
    assert s.blocks.num_free == s.blocks.size and s.blocks.num_used == 0
    assert s.slots.num_free == s.slots.size and s.slots.num_used == 0
    assert not s.running and not s.waiting and not s.requests


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
    p4, _ = sim.step()  # both decode
    assert p4.start_pos == [20, 3] and [len(t) for t in p4.token_ids] == [1, 1] and p4.is_pure_decode
    c = make(30, 2, "c", base=900)
    sim.add(c)
    p5, _ = sim.step()  # decodes first, then c's chunk gets the 6 tokens left
    assert p5.start_pos == [21, 4, 0] and [len(t) for t in p5.token_ids] == [1, 1, 6]
    assert p5.want_logits == [True, True, False]
    sim.run()
    assert a.output_ids and len(a.output_ids) == 3 and len(c.output_ids) == 2
    assert all(p.num_tokens <= 8 for p in sim.plans)
    assert_pools_full(s)


def test_many_requests_random_sizes_complete():
    import random
    rng = random.Random(0)
    s = Scheduler(num_kv_blocks=40, block_size=4, num_state_slots=3, max_num_seqs=3, max_num_batched_tokens=16)
    sim = Sim(s)
    reqs = [make(rng.randint(1, 40), rng.randint(1, 12), f"r{i}", base=1000 * i) for i in range(20)]
    for i, r in enumerate(reqs):
        sim.add(r)
        if i % 3 == 0:
            sim.step()  # requests keep arriving while others run
    sim.run()
    assert all(r.status is RequestStatus.FINISHED and len(r.output_ids) == r.params.max_tokens for r in reqs)
    assert sim.max_running <= 3
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
        assert s.abort(r.request_id) is r
        assert r.status is RequestStatus.ABORTED and r.finish_reason == "abort"
    assert s.abort("decoding") is None and s.abort("never-seen") is None
    assert_pools_full(s)
    plan, seqs = s.schedule()
    assert plan.num_seqs == 0 and not seqs
    again = make(3, 2, "decoding")  # the id is free again
    sim.add(again)
    sim.run()
    assert len(again.output_ids) == 2
    assert_pools_full(s)


def test_request_that_never_fits_is_rejected():
    s = Scheduler(num_kv_blocks=4, block_size=4, num_state_slots=2, max_num_seqs=2, max_num_batched_tokens=16)
    s.add(make(10, 7, "ok"))  # 16 cached tokens: exactly the whole cache
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(8\).*5 KV blocks.*only 4 blocks"):
        s.add(make(10, 8, "too-big"))
    with pytest.raises(ValueError, match="duplicate request id 'ok'"):
        s.add(make(1, 1, "ok"))
    with pytest.raises(ValueError, match="at least one token"):
        s.add(make(0, 1, "empty"))
    assert list(s.requests) == ["ok"]


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
