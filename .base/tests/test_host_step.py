"""The host side of a decode step (issue #10): what is kept from step to step must equal what would be built fresh,
and the one postprocess path (Scheduler.update) must give every request what it asked for.

- the scheduler's decode batch (scheduler.DecodeBatch: the decoding requests' rows kept across steps, their counts
  moved by one number) against the same scheduler building every row with _add_row, as it did before, on random
  workloads in lockstep: every plan, every row's request, every count and every pool the same;
- the sampling hints kept with the decode batch against hints worked out from every row;
- the records through Scheduler.update: a request that does not stream gets what one that streams got in pieces,
  with the engine's detokenizer (its table of token texts) and one that keeps its own text, on random completions;
  and through the engine, random traffic (stop tokens and strings, max_tokens ends, stream or not, aborts): every
  output adds up to its record, every end is the one its tokens call for;
- the detokenizer's table of token texts filled at once against the one filled as tokens come.
"""
import random

import pytest
import torch

from qwen35.sampling_params import SamplingParams
from qwen35.tokenizer import BYTE_TO_CHAR, IncrementalDetokenizer, load_tokenizer
from scheduler.plan import StepPlan
from scheduler.request import Request
from scheduler.scheduler import Scheduler, ScheduledStep

from test_scheduler import Sim, assert_pools_full


class GeneralPath(Scheduler):
    """The reference: every row of every step built by _add_row from the running list (the schedule before the
    decode batch); the batch's membership is kept up to date, but its rows are never used."""

    def schedule(self) -> ScheduledStep:
        self.step_no += 1
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
        if step.plan.num_seqs:
            step.plan.copy_states, step.plan.copy_blocks = self._copies
            self._copies, self._later = self._later, ([], [])
        if step.joining:
            self._decode.join(step.joining)
        for req in step.sampled:
            if req.num_scheduled == req.params.max_tokens:
                self.free(req)
        return step


def state(s: Scheduler) -> tuple:
    reqs = sorted([*s.running, *s.waiting], key=lambda r: r.request_id)
    return ([(r.request_id, r.num_computed, r.num_scheduled, r.state_slot, r.block_ids, r.status) for r in reqs],
            list(s.blocks._free), list(s.slots._free), [r.request_id for r in s.running],
            (s.cache.hits, s.cache.hit_tokens, s.cache.num_blocks) if s.cache else None)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_batch_equals_rows_built_fresh(lag, cache, seed):
    """Random arrivals (some while others decode, some in bursts), prompts that share prefixes, random lengths,
    stops (with the overlap's lag) and aborts: the decode batch's plans are the reference's, step by step."""
    rng = random.Random(seed)
    sims = []
    stops: dict[str, int] = {}
    for cls in (Scheduler, GeneralPath):
        s = cls(num_kv_blocks=80, block_size=4, num_state_slots=6, max_num_seqs=6, max_num_batched_tokens=24,
                snapshot_slots=[6, 7, 8, 9] if cache else (), snapshot_interval=64 if cache else 0, chunk=4)
        sims.append(Sim(s, lag=lag, stop_after=stops))
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(8, 20))] for _ in range(3)]
    fast, ref = sims
    n = 0
    steady = 0  # steps whose rows were all the decode batch's, shared as they are
    for _ in range(300):
        r = rng.random()
        if r < 0.12 or (r < 0.2 and not fast.live):
            for _ in range(rng.choice([1, 1, 1, 4])):
                prompt = rng.choice(prefixes)[:rng.randint(1, 20)] + [rng.randrange(1000) for _ in
                                                                       range(rng.randint(0, 9))]
                params = SamplingParams(max_tokens=rng.choice([1, 2, 5, 9, 20, 40]))
                if rng.random() < 0.3:
                    stops[f"r{n}"] = rng.randint(1, params.max_tokens)
                for sim in sims:
                    sim.add(Request(f"r{n}", list(prompt), params))
                n += 1
        elif r < 0.25 and fast.live:  # an abort, between steps
            rid = rng.choice(sorted(fast.live))
            for sim in sims:
                req = sim.live.pop(rid)
                req.finish_reason = "abort"
                sim.s.free(req)
                sim.ended_at[rid] = sim.step_no - 1  # (a row of it may still be in the step in flight)
        if not fast.live:
            continue
        (plan_f, step_f), (plan_r, step_r) = fast.step(), ref.step()
        assert plan_f == plan_r
        assert ids(step_f.rows) == ids(step_r.rows) and ids(step_f.sampled) == ids(step_r.sampled)
        assert ids(step_f.admitted) == ids(step_r.admitted)
        assert step_f.num_prompt_tokens == step_r.num_prompt_tokens
        assert state(fast.s) == state(ref.s)
        # the decode batch's rows are the step's first ones, those fed from the device
        assert step_f.num_decode == sum(not t for t in plan_r.token_ids)
        assert not any(plan_f.token_ids[:step_f.num_decode])
        steady += 0 < step_f.num_decode == len(step_f.rows)
    for sim in sims:
        sim.run()
        if sim.s.cache:
            sim.s.drop_cache()
        assert_pools_full(sim.s)
    assert fast.plans == ref.plans and steady > 20


def test_decode_batch_keeps_its_plans_as_built():
    """A plan shares the batch's lists: joining and leaving make new lists, so plans already built never change."""
    s = Scheduler(num_kv_blocks=64, block_size=4, num_state_slots=4, max_num_seqs=4, max_num_batched_tokens=16)
    sim = Sim(s, lag=True)
    for i in range(3):
        sim.add(Request(f"a{i}", [1, 2, 3], SamplingParams(max_tokens=6 + 3 * i)))
    for _ in range(3):
        sim.step()
    kept = [(p, StepPlan(**{f: list(getattr(p, f)) for f in ("state_slots", "token_ids", "start_pos",
                                                             "block_tables", "want_logits")})) for p in sim.plans]
    sim.add(Request("late", [4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=3)))
    sim.run()
    for plan, copy in kept:
        assert (plan.state_slots, plan.token_ids, plan.start_pos, plan.block_tables, plan.want_logits) == \
               (copy.state_slots, copy.token_ids, copy.start_pos, copy.block_tables, copy.want_logits)
    assert_pools_full(s)


# ---- the engine's sampling hints ---------------------------------------------------------------------------------

def test_sampling_hints_kept_with_the_decode_rows(tiny_dir, monkeypatch):
    """Greedy, sampled (top-k, top-p) and min_tokens requests coming and going: every step's SamplingStep equals the
    one worked out from all of its rows."""
    from qwen35 import engine as engine_module
    from qwen35.engine import EngineArgs, LLMEngine

    eng = LLMEngine(EngineArgs(model=tiny_dir, max_num_seqs=6, max_model_len=128, max_num_batched_tokens=32,
                               dtype="float32", device="cpu"))
    steps = []
    fresh = engine_module.LLMEngine._sampling_step

    def checked(self, step, admitted):
        got = fresh(self, step, admitted)
        ref = fresh(self, ScheduledStep(step.plan, step.rows, step.sampled, step.admitted), admitted)
        assert got == ref
        steps.append(step.num_decode > 0)
        return got

    monkeypatch.setattr(engine_module.LLMEngine, "_sampling_step", checked)
    rng = random.Random(0)
    kinds = [SamplingParams(max_tokens=12), SamplingParams(temperature=0.8, top_k=5, max_tokens=9, seed=1),
             SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7), SamplingParams(max_tokens=10, min_tokens=6),
             SamplingParams(temperature=0.7, max_tokens=15, min_tokens=3, seed=2)]
    n = 0
    while n < 14 or eng.has_unfinished():
        if n < 14 and rng.random() < 0.35:
            eng.add_request(f"q{n}", [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 20))],
                            rng.choice(kinds))
            n += 1
        eng.step()
    assert sum(steps) > 10 and not all(steps)


# ---- the postprocess ---------------------------------------------------------------------------------------------

def take(sched: Scheduler, req: Request, token: int):
    """One token through the postprocess (Scheduler.update, where requests end): the request's output, or None."""
    out = sched.update([req], [token])
    return out[0] if out else None


@pytest.mark.parametrize("warm", [False, True])
def test_whole_output_equals_the_streamed_one(tiny_dir, warm):
    """Random completions (plain text, split UTF-8 characters, special and stop tokens), random parameters (stop
    strings, stop ids, min_tokens, max_tokens, ignore_eos), prompts ending inside a character, aborts and failures
    between tokens, through Scheduler.update: a record with the engine's detokenizer (keep_text=False: text from
    its table of token texts) gives the outputs of one whose detokenizer keeps its own text, and one that does not
    stream gives, at its end, all that these streamed; the table is filled at start (warm) or as tokens are met."""
    tok = load_tokenizer(tiny_dir)
    if warm:
        tok.warm_detokenizer()
    rng = random.Random(0)
    words = tok.encode("The answer is 42. naïve 日本語 🙂 Q: what next? stop here\n")
    split = [tok.token_to_id(BYTE_TO_CHAR[b]) for b in "語🙂".encode()]
    eos = [248046, 248044]
    ends = {}
    for case in range(300):
        ids = [rng.choice(words + split + eos + [248045]) for _ in range(rng.randint(1, 25))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3,
                                stop=rng.choice([[], [], ["Q:"], ["語 🙂", "4"]]),
                                stop_token_ids=rng.choice([None, None, [words[0]]]))
        params.min_tokens = rng.randint(0, params.max_tokens) if rng.random() < 0.3 else 0
        prompt = [rng.choice(words + split) for _ in range(3)]
        sched = Scheduler(num_kv_blocks=8, block_size=16, num_state_slots=3, max_num_seqs=3, max_num_batched_tokens=8)
        a = Request("a", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt, keep_text=False))
        b = Request("b", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt))
        # one that does not stream: nothing until it ends, then one output with everything a's outputs carried
        c = Request("c", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt, keep_text=False),
                    stream=False)
        for r in (a, b, c):
            sched.add(r)
        streamed = ["", []]

        def check_whole(out_a, out_c):
            streamed[0] += out_a.text
            streamed[1] += out_a.token_ids
            if not out_a.finished:
                assert out_c is None, case
                return
            assert (out_c.text, out_c.token_ids) == (streamed[0], streamed[1]) == (a.text, a.output_ids), case
            assert (out_c.finished, out_c.finish_reason, out_c.error) == (True, out_a.finish_reason, out_a.error)
            assert (out_c.num_prompt_tokens, out_c.num_completion_tokens) == (out_a.num_prompt_tokens,
                                                                               out_a.num_completion_tokens)

        for t in ids:
            if rng.random() < 0.03:  # ended from outside between two tokens
                if rng.random() < 0.5:
                    out_a, out_b, out_c = (sched.abort(r.request_id) for r in (a, b, c))
                else:
                    out_a, out_b, out_c = (sched.fail(r, ValueError("x")) for r in (a, b, c))
                out_b.request_id = "a"
                assert out_a == out_b and a.text == b.text, case
                check_whole(out_a, out_c)
                break
            out_a, out_b = take(sched, a, t), take(sched, b, t)
            out_b.request_id = "a"
            assert out_a == out_b, (case, t)
            assert (a.text, a.output_ids, a.finish_reason) == (b.text, b.output_ids, b.finish_reason)
            out_c = take(sched, c, t)
            if out_c is not None:
                out_c.request_id = "a"
            check_whole(out_a, out_c)
            if a.is_finished:
                ends[a.finish_reason] = ends.get(a.finish_reason, 0) + 1
                break
        assert not sched.requests or not a.is_finished, case  # an ended request is out of the scheduler
    assert ends.keys() == {"stop", "length"} and min(ends.values()) > 30, ends


def test_detokenizer_table_filled_at_once_equals_filled_as_met(tiny_dir):
    warm, lazy = load_tokenizer(tiny_dir), load_tokenizer(tiny_dir)
    warm.warm_detokenizer()
    for skip in (False, True):
        assert [warm.clean_text(i, skip) for i in range(warm.num_real_tokens + 3)] == \
               [lazy.clean_text(i, skip) for i in range(lazy.num_real_tokens + 3)]
    rng = random.Random(0)
    ids = [rng.randrange(warm.num_real_tokens) for _ in range(3000)]
    for skip in (False, True):
        a, b = IncrementalDetokenizer(warm, skip_special_tokens=skip), IncrementalDetokenizer(lazy, skip_special_tokens=skip)
        assert [a.add(i) for i in ids] == [b.add(i) for i in ids] and a.flush() == b.flush()
        assert a.text == b.text


# ---- the postprocess through the engine --------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_ends_each_request_as_its_tokens_call_for(tiny_dir, seed, overlap):
    """One engine, its forward replaced by seeded random tokens (mostly plain text; now and then a stop token, a
    special token, a byte of a split character, a piece of a stop string), serving random requests (stream or not,
    stop strings, stop ids, min_tokens, ignore_eos, max_tokens from 1) that arrive in bursts and are sometimes
    aborted. Every request ends once; what its outputs carried adds up to its record (text and tokens, the counts);
    its end is the one its tokens call for: "length" after max_tokens tokens with no stop before, "stop" on a stop
    token past min_tokens or with a stop string in its text (cut there); and the engine counts every token taken."""
    from qwen35.engine import EngineArgs, LLMEngine

    eng = LLMEngine(EngineArgs(model=tiny_dir, max_num_seqs=12, max_model_len=128, max_num_batched_tokens=48,
                               dtype="float32", device="cpu", overlap=overlap))
    tok = eng.tokenizer
    table = tok._clean[True]
    plain = [t for t in range(1000, 3000) if table[t]]
    rare = (tok.encode(" Q: 42") + list(eng.eos_token_ids) + [248045]
            + [tok.token_to_id(BYTE_TO_CHAR[b]) for b in "語🙂".encode()])
    rng = random.Random(seed)
    forward = random.Random(seed + 1)

    def run_step(plan, sampling, half=None):  # (a CPU engine: no host ring)
        n = sum(plan.want_logits)
        picks = [forward.choice(rare) if forward.random() < 0.015 else forward.choice(plain) for _ in range(n)]
        return torch.tensor(picks) if n else None

    eng._run_step = run_step
    records, got, ends = {}, {}, {}
    n = steps = 0

    def collect(out):
        assert out.request_id not in ends, out  # nothing after the end
        text, tokens = got.get(out.request_id, ("", []))
        got[out.request_id] = (text + out.text, tokens + out.token_ids)
        if out.finished:
            ends[out.request_id] = out

    while n < 150 or eng.has_unfinished():
        steps += 1
        assert steps < 3000, "requests did not end"
        if n < 150 and (rng.random() < 0.2 or not eng.has_unfinished()):
            for _ in range(rng.choice([1, 1, 3, 8])):
                params = SamplingParams(max_tokens=rng.choice([1, 2, 7, 20, 40, 60, 100]),
                                        ignore_eos=rng.random() < 0.2,
                                        stop=rng.choice([[]] * 18 + [["Q:"], ["4", "xyz"]]),
                                        stop_token_ids=rng.choice([None] * 6 + [[plain[0], plain[1]]]))
                params.min_tokens = rng.randint(0, params.max_tokens) if rng.random() < 0.2 else 0
                prompt = [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 12))]
                eng.add_request(f"q{n}", prompt, params, stream=rng.random() < 0.6)
                records[f"q{n}"] = eng.requests[f"q{n}"]
                n += 1
        if eng.has_unfinished() and rng.random() < 0.03:
            collect(eng.abort_request(rng.choice(sorted(eng.requests))))
        for out in eng.step():
            collect(out)
    assert ends.keys() == records.keys() and not eng.requests
    reasons = {}
    for rid, req in records.items():
        out, (text, tokens) = ends[rid], got[rid]
        assert (text, tokens) == (req.text, req.output_ids), rid
        assert (out.num_completion_tokens, out.finish_reason) == (len(tokens), req.finish_reason), rid
        reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
        p, k = req.params, len(tokens)
        stop_at = next((i + 1 for i, t in enumerate(tokens) if t in req.stop_set and i + 1 > p.min_tokens), None)
        if out.finish_reason == "length":
            assert k == p.max_tokens and stop_at is None, rid
        elif out.finish_reason == "stop":
            assert stop_at == k or (p.stop and k >= p.min_tokens), rid
            if stop_at != k:  # a stop string: cut from the text, which no longer holds one
                full = tok.decode(tokens, skip_special_tokens=True)
                assert any(s in full for s in p.stop) and not any(s in req.text for s in p.stop), rid
        else:
            assert out.finish_reason == "abort" and k < p.max_tokens and stop_at is None, rid
    assert eng.total_completion_tokens == sum(len(r.output_ids) for r in records.values())
    assert min(reasons.get(r, 0) for r in ("stop", "length", "abort")) >= 3, reasons
