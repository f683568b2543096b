"""The host side of a decode step (issue #10): what is kept from step to step must equal what would be built fresh.

- the scheduler's decode batch (scheduler.DecodeBatch: the decoding requests' rows kept across steps, their counts
  moved by one number) against the same scheduler building every row with _add_row, as it did before, on random
  workloads in lockstep: every plan, every row's request, every count and every pool the same;
- the engine's sampling hints kept with the decode rows against hints worked out from every row;
- the postprocess's one call per token (Request.take_token) against append_token + take_output;
- its shortest way for many rows at once (ShortWay, the decode rows) against a take_token per row, on records and
  through the engine (random workloads: stop tokens and strings, max_tokens ends, stream or not, aborts);
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
        if step_f.decode_rows is not None:
            assert ids(step_f.decode_rows) == ids(step_f.rows[:len(step_f.decode_rows)])
            steady += step_f.rows is step_f.decode_rows
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
        steps.append(step.decode_rows is not None)
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

@pytest.mark.parametrize("warm", [False, True])
def test_take_token_equals_append_then_take(tiny_dir, warm):
    """Random completions (plain text, split UTF-8 characters, special and stop tokens), random parameters (stop
    strings, stop ids, min_tokens, max_tokens, ignore_eos), prompts ending inside a character, aborts and failures
    between tokens: take_token gives the outputs and the record of append_token followed by take_output. The
    record that takes tokens has the engine's detokenizer (keep_text=False: its shortest way, text read from the
    table, is open), the other one that keeps text (every token through add()); the table is filled at start
    (warm) or as tokens are met."""
    tok = load_tokenizer(tiny_dir)
    if warm:
        tok.warm_detokenizer()
    rng = random.Random(0)
    words = tok.encode("The answer is 42. naïve 日本語 🙂 Q: what next? stop here\n")
    split = [tok.token_to_id(BYTE_TO_CHAR[b]) for b in "語🙂".encode()]
    eos = [248046, 248044]
    shortest = 0
    for case in range(300):
        ids = [rng.choice(words + split + eos + [248045]) for _ in range(rng.randint(1, 25))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3,
                                stop=rng.choice([[], [], ["Q:"], ["語 🙂", "4"]]),
                                stop_token_ids=rng.choice([None, None, [words[0]]]))
        params.min_tokens = rng.randint(0, params.max_tokens) if rng.random() < 0.3 else 0
        prompt = [rng.choice(words + split) for _ in range(3)]
        a = Request("a", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt, keep_text=False))
        b = Request("b", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt))
        # one that does not stream: nothing until it ends, then one output with everything a's outputs carried
        c = Request("a", list(prompt), params, tuple(eos), IncrementalDetokenizer(tok, prompt, keep_text=False),
                    stream=False)
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
                end = rng.choice(["abort", "fail"])
                for r in (a, b, c):
                    r.abort() if end == "abort" else r.fail(ValueError("x"))
                out_a, out_b = a.take_output(), b.take_output()
                out_b.request_id = "a"
                assert out_a == out_b and a.text == b.text, case
                check_whole(out_a, c.take_output())
                break
            shortest += a._short and t not in a._stop_set
            out_a = a.take_token(t)
            b.append_token(t)
            out_b = b.take_output()
            out_b.request_id = "a"
            assert out_a == out_b, (case, t)
            assert (a.text, a.output_ids, a.finish_reason) == (b.text, b.output_ids, b.finish_reason)
            check_whole(out_a, c.take_token(t))
            if rng.random() < 0.2:  # (read between tokens: what c took on its short way is decoded then)
                assert c.text == a.text, case
            if a.is_finished:
                break
    assert shortest > 500  # the shortest way was taken, often


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


# ---- the postprocess's short way for the decode rows at once -----------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_way_rows_equal_take_token(tiny_dir, seed):
    """ShortWay.take over rows of records against a take_token per row on twins of them that never take its
    shortest way (their detokenizers keep no table), driven as the engine does: random tokens (plain text, stop
    tokens, specials, bytes of split characters), rows that stream or not, stop strings, stop ids, min_tokens,
    ignore_eos; aborted and failed rows that stay one more step in the rows (the step in flight), finished ones
    leaving them (a new row list); a step where a row's token can be its last goes one by one, as the scheduler
    says (decode_ends). Every step's outputs, in order, and every record's text, tokens and end are the same."""
    from scheduler.request import ShortWay

    tok = load_tokenizer(tiny_dir)
    tok.warm_detokenizer()
    rng = random.Random(seed)
    table = tok._clean[True]
    plain = [t for t in range(1000, 3000) if table[t]]
    eos = (248046, 248044)
    rare = tok.encode(" Q: 42") + list(eos) + [248045] + [tok.token_to_id(BYTE_TO_CHAR[b]) for b in "語🙂".encode()]

    def record(i, params, prompt, stream, short=True):  # short=False: a detokenizer without a table, no short way
        return Request(f"r{i}", list(prompt), params, eos, IncrementalDetokenizer(tok, prompt, keep_text=not short),
                       stream)

    pairs, n = [], 0  # (batched record, reference record)
    taken = whole = 0
    for step in range(400):
        while len(pairs) < 24 and rng.random() < 0.3:
            params = SamplingParams(max_tokens=rng.choice([2, 5, 20, 60]), ignore_eos=rng.random() < 0.2,
                                    stop=rng.choice([[]] * 8 + [["Q:"], ["4"]]),
                                    stop_token_ids=rng.choice([None] * 6 + [[plain[0]]]))
            params.min_tokens = rng.randint(0, params.max_tokens) if rng.random() < 0.2 else 0
            prompt, stream = [rng.choice(plain + rare) for _ in range(3)], rng.random() < 0.6
            pairs.append((record(n, params, prompt, stream), record(n, params, prompt, stream, short=False)))
            n += 1
        if not pairs:
            continue
        rows, refs = [a for a, _ in pairs], [b for _, b in pairs]
        short = ShortWay(rows)
        for _ in range(rng.randint(1, 8)):  # steps of these rows, as long as none leaves
            tokens = [rng.choice(rare) if rng.random() < 0.02 else rng.choice(plain) for _ in rows]
            got, want = [], []
            ends = any(len(r.output_ids) + 1 >= r.params.max_tokens for r in refs)
            left = zip(rows, tokens) if ends else short.take(tokens, got)
            for req, t in left:  # (the engine's loop)
                if req.finish_reason is None:
                    out = req.take_token(t)
                    if out is not None:
                        got.append(out)
            for req, t in zip(refs, tokens):
                if req.finish_reason is None:
                    out = req.take_token(t)
                    if out is not None:
                        want.append(out)
            assert got == want, (seed, step)
            if not ends:
                taken += short.taken
                whole += short.taken == len(rows)
            if rng.random() < 0.05:  # ended from outside, between steps; its row stays for the step in flight
                i, abort = rng.randrange(len(rows)), rng.random() < 0.5
                for req in (rows[i], refs[i]):
                    req.abort() if abort else req.fail(ValueError("x"))
                assert rows[i].take_output() == refs[i].take_output()
            if any(r.finish_reason is not None for r in refs):
                break
        for a, b in pairs:
            assert (a.text, a.output_ids, a.finish_reason, a.error) == (b.text, b.output_ids, b.finish_reason,
                                                                        b.error)
        pairs = [(a, b) for a, b in pairs if b.finish_reason is None]
    assert taken > 1000 and whole > 100, (taken, whole)


def _serve(tiny_dir, monkeypatch, batched: bool, seed: int, overlap: bool) -> tuple[list, dict]:
    """One engine, its forward replaced by seeded random tokens (mostly plain text; now and then a stop token, a
    special token, a byte of a split character, a piece of a stop string), serving random requests (stream or not,
    stop strings, stop ids, min_tokens, ignore_eos, max_tokens from 1) that arrive in bursts and are sometimes
    aborted: every step's outputs, and how the short way went (rows it took, steps it took whole and in part)."""
    from qwen35 import engine as engine_module
    from qwen35.engine import EngineArgs, LLMEngine
    from scheduler.request import ShortWay

    used = {"rows": 0, "whole": 0, "part": 0, "none": 0}

    class Counted(ShortWay):
        __slots__ = ()

        def take(self, tokens, outputs):
            yield from super().take(tokens, outputs)
            used["rows"] += self.taken
            used["whole" if self.taken == len(self.rows) else "part" if self.taken else "none"] += 1

    monkeypatch.setattr(engine_module, "ShortWay", Counted)
    monkeypatch.setattr(engine_module, "SHORT_WAY_ROWS", 2 if batched else 1 << 30)
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
    steps = []
    n = 0
    while (n < 150 or eng.has_unfinished()) and len(steps) < 3000:  # (ends by then: a request that never ends fails)
        if n < 150 and (rng.random() < 0.2 or not eng.has_unfinished()):
            for _ in range(rng.choice([1, 1, 3, 8])):
                params = SamplingParams(max_tokens=rng.choice([1, 2, 7, 20, 40, 60, 100]),
                                        ignore_eos=rng.random() < 0.2,
                                        stop=rng.choice([[]] * 18 + [["Q:"], ["4", "xyz"]]),
                                        stop_token_ids=rng.choice([None] * 6 + [[plain[0], plain[1]]]))
                params.min_tokens = rng.randint(0, params.max_tokens) if rng.random() < 0.2 else 0
                prompt = [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 12))]
                eng.add_request(f"q{n}", prompt, params, stream=rng.random() < 0.6)
                n += 1
        if eng.has_unfinished() and rng.random() < 0.03:
            rid = rng.choice(sorted(eng.requests))
            steps.append(("abort", rid, eng.abort_request(rid)))
        steps.append(eng.step())
    steps.append(("total", eng.total_completion_tokens, eng.has_unfinished()))
    return steps, used


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_short_way_for_many_rows_equals_one_by_one(tiny_dir, monkeypatch, seed, overlap):
    """The postprocess taking the decode rows' tokens at once (ShortWay) against a take_token per row, on the same
    random workload: every step's outputs (text, token ids, counts, finish reasons, which and in what order), every
    abort's output and the tokens counted are the same; the short way took most rows, some steps whole and some in
    part (around rows it left to take_token)."""
    ref, unused = _serve(tiny_dir, monkeypatch, False, seed, overlap)
    got, used = _serve(tiny_dir, monkeypatch, True, seed, overlap)
    assert unused["rows"] == 0
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a == b, i
    assert used["rows"] > 1000 and used["whole"] > 10 and used["part"] > 50, used
