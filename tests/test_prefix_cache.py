"""Whole-prompt prefix cache: a request whose prompt was seen before starts from the cached state and must produce
exactly the tokens of an engine without the cache (greedy and seeded sampling, fp32, tiny model), under eviction
by slot count and by KV-block pressure, with the same prompt in flight several times at once."""
import random

import pytest

from qwen35.engine import EngineArgs, LLMEngine
from qwen35.sampling_params import SamplingParams

_rng = random.Random(1)
# lengths around the 16-token block: no partial block (17 -> 16 cached), a partial one, tiny and long prompts
PROMPTS = [[_rng.randrange(0, 248_000) for _ in range(n)] for n in (1, 2, 16, 17, 33, 70)]
GREEDY = SamplingParams(max_tokens=12, min_tokens=12)
SEEDED = SamplingParams(max_tokens=12, min_tokens=12, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from qwen35.hub import resolve_model
    return resolve_model("tiny", cache_dir=str(tmp_path_factory.mktemp("qwen35-cache")))


def make(tiny_dir, **kw):
    kw = {"max_num_seqs": 6, "max_model_len": 128, "max_num_batched_tokens": 48, "dtype": "float32",
          "device": "cpu", **kw}
    return LLMEngine(EngineArgs(model=tiny_dir, **kw))


def run(engine, requests):
    """Add all (rid, prompt, params) at once, step to the end; {rid: token ids}."""
    for r in requests:
        engine.add_request(*r)
    out = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


@pytest.fixture(scope="module")
def expected(tiny_dir):
    eng = make(tiny_dir, prefix_cache_slots=0)
    assert eng.scheduler.cache is None
    reqs = [(f"{kind}{i}", p, params) for i, p in enumerate(PROMPTS) for kind, params in (("g", GREEDY), ("s", SEEDED))]
    return run(eng, reqs)


def test_repeated_prompts_hit_and_match(tiny_dir, expected):
    eng = make(tiny_dir)
    for round_ in range(3):  # round 0 fills the cache, later rounds hit it
        before = eng.stats()
        got = run(eng, [(f"{kind}{i}-{round_}", p, params) for i, p in enumerate(PROMPTS)
                        for kind, params in (("g", GREEDY), ("s", SEEDED))])
        for rid, ids in got.items():
            assert ids == expected[rid.split("-")[0]], rid
        s = eng.stats()
        prefilled = s["total_prompt_tokens"] - s["prefix_cache_hit_tokens"] \
            - (before["total_prompt_tokens"] - before["prefix_cache_hit_tokens"])
        if round_ > 0:  # every prompt of 2+ tokens (both requests of it) prefills only its last token
            assert s["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * (len(PROMPTS) - 1)
            assert prefilled == 2 * len(PROMPTS)
    assert s["kv_blocks_used"] == 0 and s["state_slots_used"] == 0
    assert s["prefix_cache_entries"] == len(PROMPTS) - 1


def test_eviction_by_slots_and_by_kv_pressure(tiny_dir, expected):
    # 2 snapshot slots for 5 cacheable prompts; and a KV pool so small that cached blocks must be given back
    eng = make(tiny_dir, prefix_cache_slots=2, num_kv_blocks=12, max_num_seqs=2)
    for round_ in range(2):
        got = run(eng, [(f"g{i}-{round_}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        for rid, ids in got.items():
            assert ids == expected[rid.split("-")[0]], rid
        s = eng.stats()
        assert s["prefix_cache_entries"] <= 2
        assert s["kv_blocks_used"] == 0 and s["kv_blocks_used"] + s["prefix_cache_blocks"] <= 12


def test_same_prompt_in_flight_together(tiny_dir, expected):
    eng = make(tiny_dir)
    p = PROMPTS[4]
    # added together: the first computes the prompt; those admitted after its snapshot may already hit it
    got = run(eng, [(f"g4-{k}", p, GREEDY) for k in range(4)])
    first_hits = eng.stats()["prefix_cache_hits"]
    assert first_hits < 4
    got.update(run(eng, [(f"g4-{k}", p, GREEDY) for k in range(4, 8)]))  # then all hit the one entry
    assert all(ids == expected["g4"] for ids in got.values())
    assert eng.stats()["prefix_cache_hits"] == first_hits + 4 and eng.stats()["prefix_cache_entries"] == 1


def test_abort_releases_a_hit(tiny_dir, expected):
    eng = make(tiny_dir)
    run(eng, [("warm", PROMPTS[5], GREEDY)])
    eng.add_request("x", PROMPTS[5], GREEDY)
    eng.step()
    eng.abort_request("x")
    s = eng.stats()
    assert s["kv_blocks_used"] == 0 and s["state_slots_used"] == 0
    assert eng.scheduler.cache.entries[tuple(PROMPTS[5][:-1])].users == 0
    assert run(eng, [("g5", PROMPTS[5], GREEDY)])["g5"] == expected["g5"]
