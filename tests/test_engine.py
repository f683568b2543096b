"""Output handling (stop tokens/strings, UTF-8) and the engine end to end on the tiny synthetic model (CPU, fp32).

The oracle for generated tokens is transformers' greedy `generate` on the same checkpoint; every engine run
(batched with staggered arrivals, starved of state slots and KV blocks, after aborts, TP=2 over gloo, through
AsyncEngine and LLM, with the overlapped step loop and without it) must reproduce it.
"""
import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch

from qwen35.async_engine import AsyncEngine
from qwen35.bench.step_timer import StepTimer
from qwen35.engine import EngineArgs, LLMEngine
from qwen35.sampling_params import SamplingParams
from qwen35.tokenizer import BYTE_TO_CHAR, IncrementalDetokenizer, load_tokenizer
from scheduler.request import Request
from scheduler.scheduler import Scheduler

from hf_reference import free_port, join_ranks, run_tp_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>
N_NEW = 32              # greedy tokens compared with transformers
PROMPT_LENS = [5, 70, 13, 100, 1, 33, 64, 47]
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(0, 248_000) for _ in range(n)] for n in PROMPT_LENS]
# min_tokens = max_tokens suppresses EOS for the whole completion, exactly like transformers' min_new_tokens
GREEDY = SamplingParams(max_tokens=N_NEW, min_tokens=N_NEW)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def hf_tokens(tiny_dir):
    """transformers' greedy continuation of each prompt (EOS suppressed, as in GREEDY)."""
    from transformers import Qwen3_5MoeForCausalLM
    model = Qwen3_5MoeForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def make_engine(tiny_dir, **kw):
    kw = {"max_num_seqs": 8, "max_model_len": 256, "max_num_batched_tokens": 64, "dtype": "float32",
          "device": "cpu", **kw}
    return LLMEngine(EngineArgs(model=tiny_dir, **kw))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def small_engine(tiny_dir):
    # 2 state slots, and KV for 160 tokens: prompts 70 and 100 (+32 new) need 7 + 9 blocks, so cannot run together
    return make_engine(tiny_dir, max_num_seqs=2, num_kv_blocks=10, max_model_len=160)


def record_plans(engine, monkeypatch):
    plans = []
    sample_step = engine.runner.sample_step

    def wrapped(plan, *args, **kw):
        plans.append(plan)
        return sample_step(plan, *args, **kw)
    monkeypatch.setattr(engine.runner, "sample_step", wrapped)
    return plans


def run(engine, requests, arrive_every=0):
    """Add (rid, prompt, params) requests, the i-th before step i*arrive_every; run until all finish.
    Returns {rid: (token_ids, text, finish_reason, num_completion_tokens)} and the engine stats after each step."""
    got = {rid: ([], "") for rid, _, _ in requests}  # and any request added before the call
    final = {}
    pending = list(requests)
    step, history = 0, []
    while pending or engine.has_unfinished():
        while pending and step >= arrive_every * (len(requests) - len(pending)):
            engine.add_request(*pending.pop(0))
        for o in engine.step():
            ids, text = got.get(o.request_id, ([], ""))
            got[o.request_id] = (ids + o.token_ids, text + o.text)
            if o.finished:
                final[o.request_id] = (*got[o.request_id], o.finish_reason, o.num_completion_tokens)
        history.append(engine.stats())
        step += 1
        assert step < 2000
    return final, history


def engine_with_blocks(engine, num_kv_blocks):
    """engine's request limits with a KV cache of num_kv_blocks blocks (for check_request only)."""
    import dataclasses as dc
    import types
    return types.SimpleNamespace(limits=dc.replace(engine.limits, num_kv_blocks=num_kv_blocks))


def assert_pools_empty(engine):
    s = engine.stats()
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_used"], s["state_slots_used"]) == (0, 0, 0, 0), s
    assert not engine.has_unfinished()


# ---- outputs: stop handling and detokenization ----------------------------------------------------------------

def record(tok, params, prompt=(1, 2, 3)) -> tuple[Scheduler, Request]:
    """A request record, queued in a scheduler of its own, whose update() takes its tokens (where requests end)."""
    req = Request("r", list(prompt), params, tuple(EOS), IncrementalDetokenizer(tok, list(prompt)))
    sched = Scheduler(num_kv_blocks=8, block_size=16, num_state_slots=1, max_num_seqs=1, max_num_batched_tokens=8)
    sched.add(req)
    return sched, req


def stream(tok, ids, params, prompt=(1, 2, 3)):
    """Feed `ids` one at a time to a request record; returns (streamed text chunks, the record)."""
    sched, st = record(tok, params, prompt)
    chunks = []
    for t in ids:
        chunks.append(sched.update([st], [t])[0].text)
        if st.is_finished:
            break
    return chunks, st


def assert_streamed_prefixes(chunks, final):
    # streamed text is never taken back: every partial concatenation is a prefix of the final text
    acc = ""
    for c in chunks:
        acc += c
        assert final.startswith(acc), (acc, final)
    assert acc == final


TEXT = "The answer is 42.\nQ: what next? More text here."


def test_stop_string_across_tokens_is_removed(tok):
    ids = tok.encode(TEXT)
    assert all("\nQ:" not in tok.decode([i]) for i in ids)  # premise: the stop string spans several tokens
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=100, stop=["\nQ:"]))
    assert st.text == "The answer is 42." and st.finish_reason == "stop"
    assert_streamed_prefixes(chunks, st.text)
    # generation stopped at the token completing the stop string; all tokens so far are reported
    assert tok.decode(st.output_ids) == "The answer is 42.\nQ:"


def test_earliest_stop_string_wins_and_streaming_holds_back(tok):
    ids = tok.encode(TEXT)
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=100, stop=["next", "is 4"]))
    assert st.text == "The answer " and st.finish_reason == "stop"
    assert_streamed_prefixes(chunks, st.text)
    # a stop string that never matches: its length - 1 characters are held back, then flushed at the end
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=len(ids), stop=["@@@@@@"]))
    assert st.finish_reason == "length" and st.text == TEXT
    assert_streamed_prefixes(chunks, TEXT)
    sent = "".join(chunks[:-1])
    assert len(sent) <= len(TEXT) - 5 and chunks[-1] == TEXT[len(sent):]


def test_max_tokens_gives_length(tok):
    ids = tok.encode(TEXT)
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=5))
    assert st.finish_reason == "length" and st.output_ids == ids[:5]
    assert "".join(chunks) == st.text == tok.decode(ids[:5])
    out = st.take_output()
    assert out.finished and out.num_completion_tokens == 5 and out.num_prompt_tokens == 3


def test_stop_tokens_and_ignore_eos(tok):
    ids = tok.encode("Hello world") + [EOS[0]] + tok.encode(" more")
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=50))
    assert st.finish_reason == "stop" and st.text == "Hello world" and st.output_ids[-1] == EOS[0]
    assert len(st.output_ids) == len(tok.encode("Hello world")) + 1
    chunks, st = stream(tok, ids + [EOS[1]], SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True))
    assert st.finish_reason == "length" and st.output_ids == ids + [EOS[1]]
    assert st.text == "Hello world more"  # special tokens carry no text
    # ignore_eos keeps stop strings
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=50, ignore_eos=True, stop=["mo"]))
    assert st.finish_reason == "stop" and st.text == "Hello world "
    # explicit stop_token_ids replace the EOS set
    world = tok.encode(" world")[0]
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=50, stop_token_ids=[world]))
    assert st.finish_reason == "stop" and st.text == "Hello"


def test_min_tokens_suppresses_stop_tokens(tok):
    sched, st = record(tok, SamplingParams(max_tokens=10, min_tokens=2), [1])
    assert st.suppressed_ids(len(st.output_ids)) == tuple(EOS)
    sched.update([st], [100])
    assert st.suppressed_ids(len(st.output_ids)) == tuple(EOS)
    sched.update([st], [101])
    assert st.suppressed_ids(len(st.output_ids)) == ()
    sched.update([st], [EOS[1]])
    assert st.finish_reason == "stop"
    assert record(tok, SamplingParams(min_tokens=2, ignore_eos=True), [1])[1].suppressed_ids(0) == ()


def test_multibyte_utf8_split_over_tokens(tok):
    byte_ids = [tok.hf.token_to_id(BYTE_TO_CHAR[b]) for b in "🙂".encode()]  # one token per byte
    ids = tok.encode("naïve 日本語 ") + byte_ids + tok.encode(" ok")
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=len(ids)))
    assert st.text == "naïve 日本語 🙂 ok" and not any("\ufffd" in c for c in chunks)
    assert_streamed_prefixes(chunks, st.text)
    # a stop string made of multi-byte characters, completed by the emoji's last byte
    chunks, st = stream(tok, ids, SamplingParams(max_tokens=len(ids), stop=["語 🙂"]))
    assert st.text == "naïve 日本" and st.finish_reason == "stop"
    assert_streamed_prefixes(chunks, st.text)
    # the completion ends inside a character: rendered as U+FFFD, like a full decode
    chunks, st = stream(tok, ids[:-3], SamplingParams(max_tokens=len(ids) - 3))
    assert st.text == tok.decode(ids[:-3]) and st.text.endswith("\ufffd")


# ---- engine end to end ------------------------------------------------------------------------------------------

def test_batched_greedy_matches_alone_and_transformers(engine, hf_tokens, monkeypatch):
    plans = record_plans(engine, monkeypatch)
    before = engine.stats()
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    batched, history = run(engine, reqs, arrive_every=2)
    # the run really was continuous batching: chunked prefills, and steps mixing decodes with prefill chunks
    assert max(h["num_running"] for h in history) >= 5
    assert any(p.want_logits.count(False) for p in plans)
    # decode rows feed the token sampled at the step before, which stays on the device (no host tokens)
    assert any(any(not t and s > 0 for t, s in zip(p.token_ids, p.start_pos))
               and any(len(t) > 1 for t in p.token_ids) for p in plans)
    assert max(p.num_tokens for p in plans) <= 64
    for i, p in enumerate(PROMPTS):
        ids, text, reason, n = batched[f"r{i}"]
        assert ids == hf_tokens[i], f"prompt {i} (len {len(p)}) differs from transformers"
        assert reason == "length" and n == N_NEW and text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        alone, _ = run(engine, [(f"alone{i}", p, GREEDY)])
        assert alone[f"alone{i}"][0] == ids
    assert_pools_empty(engine)
    s = engine.stats()
    assert s["total_prompt_tokens"] - before["total_prompt_tokens"] == 2 * sum(PROMPT_LENS)
    assert s["total_completion_tokens"] - before["total_completion_tokens"] == 2 * len(PROMPTS) * N_NEW


def test_one_token_requests_admitted_and_ended_in_one_step(engine):
    """A request whose prompt is fed whole in its admission step and whose max_tokens is 1 ends in that same step:
    the scheduler frees it while scheduling, so its sampler settings must come from the plan's row (it used to read
    the freed slot, None, and take the engine down). The second round hits the prefix cache: one row at admission."""
    prompt = list(range(5, 40))
    for r in range(3):
        final, _ = run(engine, [(f"one{r}", prompt, SamplingParams(max_tokens=1, seed=3)),
                                (f"three{r}", prompt, SamplingParams(max_tokens=3))])
        assert final[f"one{r}"][2:] == ("length", 1), final
        assert final[f"three{r}"][2:] == ("length", 3), final
        if r:  # seeded: the same token each round
            assert final[f"one{r}"][0] == first
        first = final[f"one{r}"][0]
    assert_pools_empty(engine)


def test_warm_up_covers_the_step_shapes_and_leaves_no_trace(tiny_dir):
    """The start-up steps (ModelRunner.warm_up) meet every power-of-two token bucket as T and T - 1 tokens, mixed
    steps (decode rows first, then a chunk resuming at CHUNK) and a checkpoint; and an engine that ran them gives
    the same greedy tokens as one that did not (what they leave in slots and blocks is never read)."""
    from layers.deltanet_prefill import CHUNK
    kw = dict(max_model_len=512, max_num_batched_tokens=256)
    warm, fresh = make_engine(tiny_dir, **kw), make_engine(tiny_dir, **kw)
    plans = warm.runner.warm_up_plans(256)
    counts = {p.num_tokens for p in plans}
    assert {t for k in range(9) for t in (2 ** k, 2 ** k - 1)} - {0} <= counts
    mixed = [p for p in plans if p.token_ids[0] == []]
    assert {p.num_seqs - 1 for p in mixed} == {1, 2, 4}  # 15 or 16 decode rows and a chunk do not fit 8 slots
    assert {255, 256, 15, 16} <= {p.num_tokens for p in mixed}
    for p in mixed:
        assert all(t == [] and s == CHUNK for t, s in zip(p.token_ids[:-1], p.start_pos[:-1]))
        assert p.start_pos[-1] == CHUNK and len(p.token_ids[-1]) >= 2
    prompts = [p for p in plans if p.token_ids[0] != []]
    assert all(s == 0 for p in prompts for s in p.start_pos) and {1, 2} == {p.num_seqs for p in prompts}
    assert any(p.checkpoints for p in plans) and max(p.num_seqs for p in plans) <= 8
    assert warm.runner.warm_up(256) == len(plans)
    requests = [(f"r{i}", list(range(3 + i, 90 + 7 * i)), SamplingParams(max_tokens=6, temperature=0.0))
                for i in range(3)]
    got, want = run(warm, requests)[0], run(fresh, requests)[0]
    assert got == want


def test_block_tables_set_in_one_copy(tiny_dir):
    """runner._set_tables writes each table the plan sets (tables of different lengths, slots out of order) into
    its slot's row and nothing else, and records each set table's length."""
    from scheduler.plan import StepPlan
    runner = make_engine(tiny_dir).runner
    before, lens = runner.block_table.clone(), list(runner._table_len)
    tables = {3: [5, 9, 2], 0: [7], 1: [], 2: list(range(10, 10 + runner.max_blocks_per_seq))}
    runner._set_tables(StepPlan(state_slots=list(tables), block_tables=list(tables.values())))
    want = before.clone()
    for slot, t in tables.items():
        want[slot, :len(t)] = torch.tensor(t, dtype=torch.int32)
    assert torch.equal(runner.block_table, want)
    assert [runner._table_len[s] for s in (3, 0, 2)] == [3, 1, runner.max_blocks_per_seq]
    assert runner._table_len[1] == lens[1]


@pytest.mark.parametrize("overlap", [True, False])
def test_random_request_mix_never_takes_the_engine_down(tiny_dir, overlap):
    """Seeded random traffic on a small engine (4 slots, 40 blocks, 6 snapshots): prompts of 1..150 tokens around
    the block and chunk sizes, most sharing a prefix (cache hits), max_tokens 1..40 (one-token requests end in
    their admission step), greedy and sampled, seeded and not, aborts. Every request ends with its own reason, and
    the pools are empty at the end."""
    eng = make_engine(tiny_dir, max_num_seqs=4, num_kv_blocks=40, prefix_cache_snapshots=6,
                      prefix_cache_interval=64, overlap=overlap)
    for seed in range(4):
        rng = random.Random(seed)
        base = [rng.randrange(1000, 5000) for _ in range(200)]
        live, ended, k = set(), {}, 0
        for _ in range(80):
            if rng.random() < 0.4:
                n = rng.choice([1, 2, 15, 16, 17, 63, 64, 65, 100, 150])
                ids = base[:n] if rng.random() < 0.6 else [rng.randrange(1000, 5000) for _ in range(n)]
                params = SamplingParams(max_tokens=rng.choice([1, 1, 2, 3, 8, 40]), ignore_eos=True,
                                        temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, 7]))
                rid, k = f"{seed}-{k}", k + 1
                eng.add_request(rid, ids, params)
                live.add(rid)
            if live and rng.random() < 0.05:
                rid = rng.choice(sorted(live))
                eng.abort_request(rid)
                live.discard(rid)
                ended[rid] = "abort"
            for o in eng.step():
                if o.finished:
                    live.discard(o.request_id)
                    ended.setdefault(o.request_id, o.finish_reason)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    ended.setdefault(o.request_id, o.finish_reason)
        assert len(ended) == k and set(ended.values()) <= {"length", "abort"}, ended
        assert_pools_empty(eng)


def test_more_requests_than_slots_and_blocks(small_engine, hf_tokens):
    eng = small_engine
    assert eng.stats()["state_slots_total"] == 2 and eng.stats()["kv_blocks_total"] == 10
    reqs = [(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    done, history = run(eng, reqs)
    assert max(h["num_running"] for h in history) == 2
    # at times a free state slot went unused because KV blocks ran out
    assert any(h["num_running"] == 1 and h["num_waiting"] > 0 for h in history)
    for i in range(len(PROMPTS)):
        assert done[f"s{i}"][0] == hf_tokens[i]
    assert_pools_empty(eng)


def test_invalid_requests_rejected(engine):
    # checked once, where requests come in (the server, LLM); the engine behind that trusts them
    with pytest.raises(ValueError, match=r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds max_model_len "
                                         r"\(256\)"):
        engine.check_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="at least one token"):
        engine.check_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.check_request([248_320], SamplingParams())
    with pytest.raises(ValueError, match=r"needs 14 KV blocks of 16 tokens, but the KV cache holds only 10 blocks"):
        LLMEngine.check_request(engine_with_blocks(engine, 10), [1] * 200, SamplingParams(max_tokens=10))
    engine.check_request([1, 2], SamplingParams(max_tokens=2))
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert_pools_empty(engine)


def test_abort_frees_everything(small_engine, hf_tokens):
    eng = small_engine
    for i in range(4):
        eng.add_request(f"a{i}", PROMPTS[i], GREEDY)
    for _ in range(3):
        eng.step()
    s = eng.stats()
    assert s["num_running"] == 2 and s["num_waiting"] == 2 and s["state_slots_used"] == 2
    outs = [eng.abort_request(f"a{i}") for i in range(4)]
    assert [o.finish_reason for o in outs] == ["abort"] * 4 and all(o.finished for o in outs)
    assert eng.abort_request("a0") is None
    assert_pools_empty(eng)
    assert eng.step() == []
    # slots and blocks handed to new requests start clean: results unaffected by the aborted ones
    done, _ = run(eng, [("b1", PROMPTS[1], GREEDY), ("b3", PROMPTS[3], GREEDY)])
    assert done["b1"][0] == hf_tokens[1] and done["b3"][0] == hf_tokens[3]


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, min_tokens=24, seed=77)


def test_seeded_sampling_reproducible(engine):
    alone, _ = run(engine, [("seeded", PROMPTS[2], SEEDED)])
    companions = [("c0", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=30)),
                  ("c1", PROMPTS[5], SamplingParams(temperature=0.7, seed=77, max_tokens=20)),
                  ("seeded", PROMPTS[2], SEEDED),
                  ("c3", PROMPTS[1], GREEDY)]
    batched, _ = run(engine, companions, arrive_every=1)
    assert batched["seeded"][0] == alone["seeded"][0]
    other, _ = run(engine, [("seeded", PROMPTS[2], dataclasses.replace(SEEDED, seed=78))])
    assert other["seeded"][0] != alone["seeded"][0]
    assert_pools_empty(engine)


def early_stops(tok, hf_tokens):
    """Requests over every prompt that end before max_tokens: greedy on a stop token (expected: the transformers
    continuation up to that token), greedy on a stop string (taken from that continuation, so it must fire), and
    seeded sampling with the same stop string. Returns the requests, the expected tokens, the ids that must stop."""
    reqs, expect, must_stop = [], {}, []
    for i, ref in enumerate(hf_tokens):
        j = 2 + i % 5
        stop_id = ref[j]
        reqs.append((f"tok{i}", PROMPTS[i], SamplingParams(max_tokens=N_NEW, stop_token_ids=[stop_id])))
        expect[f"tok{i}"] = ref[:ref.index(stop_id) + 1]
        stop = tok.decode(ref[j:j + 2], skip_special_tokens=True).strip()[:3]
        if stop:
            must_stop.append(f"str{i}")
        reqs.append((f"str{i}", PROMPTS[i], SamplingParams(max_tokens=N_NEW, stop=[stop or "@@"])))
        seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=i, stop=[stop or "@@"])
        reqs.append((f"seed{i}", PROMPTS[i], seeded))
    return reqs, expect, must_stop


def test_overlapped_loop_equals_serial_loop(small_engine, tiny_dir, tok, hf_tokens):
    """Queueing step N+1 before taking step N's tokens gives the tokens of a loop that ends each step first: greedy
    and seeded, with requests that stop early on a stop token or string (a row of theirs is already queued at the
    next step, and its token must go nowhere), and 2 state slots for 24 requests (slots and blocks of stopped
    requests reused by later ones at once)."""
    serial = make_engine(tiny_dir, max_num_seqs=2, num_kv_blocks=10, max_model_len=160, overlap=False)
    assert small_engine.overlap and not serial.overlap
    reqs, expect, must_stop = early_stops(tok, hf_tokens)
    assert len(must_stop) >= len(PROMPTS) // 2
    got = {}
    for eng in (small_engine, serial):
        steps0, eng.timer = eng.num_steps, StepTimer(eng)  # the bench's opt-in hook on the step loop
        got[eng.overlap], _ = run(eng, reqs, arrive_every=1)
        timer, eng.timer = eng.timer, None
        assert_pools_empty(eng)
        assert timer.steps == eng.num_steps - steps0 and timer.host_s > 0 and timer.forward_s > 0  # per step queued
    assert got[True] == got[False]
    for rid, tokens in expect.items():
        assert got[True][rid][0] == tokens and got[True][rid][2] == "stop", rid
    for rid in must_stop:
        assert got[True][rid][2] == "stop" and got[True][rid][3] < N_NEW, (rid, got[True][rid])


def test_abort_with_a_step_in_flight(small_engine, hf_tokens):
    eng = small_engine
    assert eng.overlap
    eng.add_request("gone", PROMPTS[0], GREEDY)
    eng.add_request("stays", PROMPTS[1], GREEDY)
    early = {"gone": [], "stays": []}
    while len(early["gone"]) < 3:
        for o in eng.step():
            early[o.request_id] += o.token_ids
    assert eng._in_flight is not None and any(r.request_id == "gone" for r in eng._in_flight.sampled)
    out = eng.abort_request("gone")  # its next token is being computed: it is dropped, its slot is free at once
    assert out.finish_reason == "abort" and not out.token_ids and eng.stats()["state_slots_used"] == 1
    eng.add_request("reuses", PROMPTS[3], GREEDY)  # takes the aborted request's slot
    done, _ = run(eng, [])
    assert "gone" not in done and early["stays"] + done["stays"][0] == hf_tokens[1]
    assert done["reuses"][0] == hf_tokens[3] and early["gone"] == hf_tokens[0][:len(early["gone"])]
    assert_pools_empty(eng)


@pytest.mark.gpu
def test_gpu_queueing_a_step_never_waits_for_the_device(tiny_dir):
    """On a GPU, queueing a step (schedule, plan, forward, sampling, the tokens into the next step's input and their
    copy to the host) never waits for the device: torch's sync debug mode turns any wait into an error. The
    overlapped loop gives the serial loop's tokens (bf16, fast kernels, CUDA graphs; every request runs to
    max_tokens, so that both loops run the very same batches and bf16 rounding cannot differ)."""
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=N_NEW, min_tokens=N_NEW, seed=7)
    reqs = [(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])] + \
        [(f"s{i}", p, dataclasses.replace(sampled, seed=i)) for i, p in enumerate(PROMPTS[4:])]
    got = {}
    for overlap in (True, False):
        eng = LLMEngine(EngineArgs(model=tiny_dir, device="cuda", max_num_seqs=4, max_model_len=256,
                                   max_num_batched_tokens=64, overlap=overlap, speculative_tokens=0))
        assert eng.runner.graphs is not None
        run(eng, [(f"warm{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])  # kernels compiled, graphs warm
        launch = eng._launch

        def strict(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        eng._launch = strict
        eng.timer = timer = StepTimer(eng)
        got[overlap], _ = run(eng, reqs, arrive_every=1)
        assert_pools_empty(eng)
        assert timer.gpu_gaps > 0
    assert got[True] == got[False]


def tp2_tokens(engine: LLMEngine) -> dict:
    reqs = [(f"r{i}", PROMPTS[i], GREEDY) for i in (0, 1, 3)] + [("seeded", PROMPTS[2], SEEDED)]
    done, _ = run(engine, reqs, arrive_every=1)
    return {k: v[0] for k, v in done.items()}


def test_tp2_matches_tp1(engine, hf_tokens, tiny_dir, cache_dir, tmp_path):
    got = run_tp_engine(2, partial(make_engine, tiny_dir, tp=2), tp2_tokens, str(tmp_path / "tp2.pt"),
                        QWEN35_CACHE=cache_dir)
    for i in (0, 1, 3):
        assert got[f"r{i}"] == hf_tokens[i]
    tp1, _ = run(engine, [("seeded", PROMPTS[2], SEEDED)])
    assert got["seeded"] == tp1["seeded"][0]


def run_broken(engine, requests, break_params) -> dict:
    """Add the requests, then break_params() (what validation would have refused), then run them all to the end;
    {rid: (token_ids, finish_reason, error)}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    break_params()
    got = {rid: [] for rid, _, _ in requests}
    final = {}
    for _ in range(200):
        for o in engine.step():
            got[o.request_id] += o.token_ids
            if o.finished:
                final[o.request_id] = (got[o.request_id], o.finish_reason, o.error)
        if not engine.has_unfinished():
            return final
    raise AssertionError("requests did not finish")


def test_a_failing_request_fails_alone(engine, hf_tokens, monkeypatch):
    """The step loop's last line of defence: an exception raised for one request inside the step (its sampling, its
    output handling) ends that request with finish_reason "error" and frees it; the others go on as if it were not
    there, and the engine keeps serving."""
    broken = SamplingParams(temperature=1.0, max_tokens=8)

    class BrokenDetokenizer:  # what the postprocess (Scheduler.update) reaches for the text of each token
        pending = False

        def add(self, token_id):
            raise UnicodeError("the detokenizer broke")

        def flush(self):
            return ""

    def break_both():
        broken.top_p = "0.9"  # torch refuses it in the step
        req = engine.requests["broken-output"]
        req.detokenizer, req.token_texts, req.text_table = BrokenDetokenizer(), (), ()

    reqs = [("ok", PROMPTS[0], GREEDY), ("broken-sampling", PROMPTS[1], broken),
            ("broken-output", PROMPTS[5], SamplingParams(max_tokens=8)), ("ok3", PROMPTS[3], GREEDY)]
    done = run_broken(engine, reqs, break_both)
    assert done["ok"][:2] == (hf_tokens[0], "length") and done["ok3"][:2] == (hf_tokens[3], "length")
    assert done["broken-sampling"][1] == done["broken-output"][1] == "error"
    assert "TypeError" in done["broken-sampling"][2] and "detokenizer broke" in done["broken-output"][2]
    assert_pools_empty(engine)
    monkeypatch.undo()
    again, _ = run(engine, [("after", PROMPTS[0], GREEDY)])
    assert again["after"][0] == hf_tokens[0]
    assert_pools_empty(engine)


def test_stop_token_ids_past_the_vocabulary_are_refused(engine):
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.check_request(PROMPTS[0], SamplingParams(stop_token_ids=[300000], min_tokens=2, max_tokens=4))
    assert_pools_empty(engine)


# ---- AsyncEngine --------------------------------------------------------------------------------------------------

async def collect(it):
    ids, text, last = [], "", None
    async for o in it:
        ids += o.token_ids
        text += o.text
        last = o
    return ids, text, last


async def wait_until(pred, timeout=20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_async_engine(small_engine, hf_tokens):
    async def main(ae: AsyncEngine):
        assert ae.ready
        # what the server checks before generate(): invalid requests are refused before anything is queued
        with pytest.raises(ValueError, match=r"= 161 exceeds max_model_len \(160\)"):
            ae.check_request([1] * 150, SamplingParams(max_tokens=11))
        with pytest.raises(ValueError, match="at least one token"):
            ae.check_request([], SamplingParams())
        # concurrent streams, more than the 2 state slots; both `async for` and `await` forms
        streams = [ae.generate(f"q{i}", PROMPTS[i], GREEDY) for i in range(3)]
        with pytest.raises(ValueError, match="duplicate request id 'q0'"):
            ae.generate("q0", PROMPTS[0], GREEDY)
        streams.append(await ae.generate("q3", PROMPTS[3], GREEDY))
        results = await asyncio.gather(*(collect(s) for s in streams))
        for i, (ids, text, last) in enumerate(results):
            assert ids == hf_tokens[i] and last.finished and last.finish_reason == "length"
            assert last.num_completion_tokens == N_NEW and last.num_prompt_tokens == len(PROMPTS[i])
        # not streamed: one output at the end, the whole completion (its text as the streamed outputs joined)
        whole = [o async for o in ae.generate("whole", PROMPTS[1], GREEDY, stream=False)]
        assert len(whole) == 1 and whole[0].finished and whole[0].finish_reason == "length"
        assert whole[0].token_ids == hf_tokens[1] and whole[0].text == results[1][1]
        assert whole[0].num_completion_tokens == N_NEW
        # the id is free again once its stream finished
        ids, _, _ = await collect(ae.generate("q0", PROMPTS[0], SamplingParams(max_tokens=3, min_tokens=3)))
        assert ids == hf_tokens[0][:3]
        # explicit abort
        s = ae.generate("ab", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
        first = await s.__anext__()
        assert first.token_ids and not first.finished
        ae.abort("ab")
        _, _, last = await collect(s)
        assert last.finish_reason == "abort"
        # a consumer that goes away (cancelled task, or dropping the stream) aborts its request
        before = ae.stats()["total_completion_tokens"]
        task = asyncio.create_task(collect(ae.generate("gone", PROMPTS[0], SamplingParams(max_tokens=100))))
        await wait_until(lambda: ae.stats()["total_completion_tokens"] > before + 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        dropped = ae.generate("dropped", PROMPTS[0], SamplingParams(max_tokens=100))
        await dropped.__anext__()
        del dropped
        await wait_until(lambda: ae.stats()["state_slots_used"] == 0 and ae.stats()["kv_blocks_used"] == 0)
        assert ae.stats()["total_completion_tokens"] < before + 100  # not the 200 tokens asked for

    ae = AsyncEngine(small_engine)
    try:
        asyncio.run(main(ae))
    finally:
        ae.shutdown()
    assert not ae.ready
    assert_pools_empty(small_engine)


def test_step_loop_failure_ends_the_process(tiny_dir, cache_dir):
    script = textwrap.dedent(f"""
        import asyncio
        from qwen35.async_engine import AsyncEngine
        from qwen35.engine import EngineArgs, LLMEngine
        from qwen35.sampling_params import SamplingParams
        eng = LLMEngine(EngineArgs(model={tiny_dir!r}, max_num_seqs=2, max_model_len=64, device="cpu"))
        def broken(plan, *args, **kw):
            raise RuntimeError("boom in the forward")
        eng.runner.sample_step = broken
        async def main():
            async for _ in AsyncEngine(eng).generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                pass
        asyncio.run(main())
    """)
    env = {**os.environ, "QWEN35_CACHE": cache_dir, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" in r.stderr and "RuntimeError: boom in the forward" in r.stderr


# ---- offline LLM ----------------------------------------------------------------------------------------------------

def test_llm_generate(tiny_dir, tok):
    from qwen35.llm import LLM
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256)
    chat = [{"role": "user", "content": "What is 7 * 8?", "type": "text"}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False)
    assert "<think>\n\n</think>" in rendered  # thinking disabled
    params = SamplingParams(max_tokens=12, min_tokens=12)
    one = llm.generate("Hello there", params)
    many = llm.generate(["Hello there", rendered, "x"], params)
    chats = llm.generate([chat, chat[:1]], params)
    single_chat = llm.generate(chat, params)
    assert len(one) == 1 and len(many) == 3 and len(chats) == 2 and len(single_chat) == 1
    assert one[0].token_ids == many[0].token_ids and len(one[0].token_ids) == 12
    # a chat goes through the template with thinking off: same tokens as its rendered text
    assert chats[0].token_ids == chats[1].token_ids == single_chat[0].token_ids == many[1].token_ids
    assert chats[0].usage.prompt_tokens == len(tok.encode(rendered))
    r = many[2]
    assert r.finish_reason == "length" and r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (1, 12, 13)
    per_prompt = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)])
    assert [len(o.token_ids) for o in per_prompt] == [2, 5]
    with pytest.raises(ValueError, match="exceeds max_model_len"):  # all or nothing
        llm.generate(["hi", "fine, thanks a lot"], SamplingParams(max_tokens=253))
    assert not llm.engine.has_unfinished()


@pytest.mark.gpu
def test_gpu_sampling_tails_give_the_eager_tokens(tiny_dir, monkeypatch):
    """The engine's pure-decode steps run their sampling as tail graphs (greedy and plain temperature rows; no
    min_tokens, so nothing is suppressed): the same tokens as with every tail sampled eagerly. Four prompts of one
    length arrive together, so every decode step has four rows, the graph's own size (no padded row changes a GEMM's
    row count between the two runs)."""
    import qwen35.runner as runner_module
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(24)] for i in range(4)]
    params = [SamplingParams(max_tokens=N_NEW, ignore_eos=True),
              SamplingParams(max_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=3)]
    got = {}
    for tails in (True, False):
        eng = LLMEngine(EngineArgs(model=tiny_dir, device="cuda", max_num_seqs=4, max_model_len=256,
                                   max_num_batched_tokens=256, speculative_tokens=0))
        assert eng.runner.graphs is not None and eng.runner.graphs.tails
        replays = []
        run_tail = eng.runner.graphs.run_tail
        monkeypatch.setattr(eng.runner.graphs, "run_tail", lambda *a: replays.append(a) or run_tail(*a))
        if not tails:
            monkeypatch.setattr(runner_module, "tail_mode", lambda step: None)
        for p in params:
            got[tails, p.temperature], _ = run(eng, [(f"r{i}", q, p) for i, q in enumerate(prompts)])
        assert len(replays) >= (2 * (N_NEW - 2) if tails else 0)
        monkeypatch.undo()
    assert got[True, 0.0] == got[False, 0.0] and got[True, 0.8] == got[False, 0.8]


def _tp_tails_worker(rank, port, tiny_dir, cache_dir, out_path):
    import qwen35.runner as runner_module
    from dist import parallel
    join_ranks(rank, 2, port, "cuda", hang_s=240, QWEN35_CACHE=cache_dir)
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(24)] for i in range(4)]
    params = [SamplingParams(max_tokens=N_NEW, ignore_eos=True),
              SamplingParams(max_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=3)]
    got, tail_mode = {}, runner_module.tail_mode
    try:
        for tails in (True, False):
            runner_module.tail_mode = tail_mode if tails else (lambda step: None)
            eng = LLMEngine(EngineArgs(model=tiny_dir, device="cuda", tp=2, max_num_seqs=4, max_model_len=256,
                                       max_num_batched_tokens=256, speculative_tokens=0))
            replays = []
            run_tail = eng.runner.graphs.run_tail
            eng.runner.graphs.run_tail = lambda *a: replays.append(a) or run_tail(*a)
            if rank == 0:
                for p in params:
                    got[tails, p.temperature] = run(eng, [(f"r{i}", q, p) for i, q in enumerate(prompts)])[0]
                eng.shutdown()
            else:
                eng.run_worker_loop()
            got[tails, "replays"] = len(replays)
            del eng
        torch.save(got, f"{out_path}.{rank}")
    finally:
        parallel.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_sampling_tails_give_the_eager_tokens(tiny_dir, cache_dir, tmp_path):
    """The same at TP=2: each rank replays its tails (the sampling's candidates cross the ranks inside the graphs;
    rank 0's alternate between the host ring's halves, the other rank's feed the device only), and the tokens are
    those of eager sampling after the same decode graphs."""
    out = tmp_path / "tails"
    torch.multiprocessing.spawn(_tp_tails_worker, args=(free_port(), tiny_dir, cache_dir, str(out)), nprocs=2)
    driver, worker = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert driver[True, 0.0] == driver[False, 0.0] and driver[True, 0.8] == driver[False, 0.8]
    assert driver[True, "replays"] == worker[True, "replays"] >= 2 * (N_NEW - 2)
    assert driver[False, "replays"] == worker[False, "replays"] == 0
