"""qwen35.bench --mode spec (qwen35/bench/spec.py) on the tiny preset, CPU: every (batch, k) row, tokens per step
above one where drafts are accepted (dummy-spec weights) and exactly one with speculation off, the acceptance
measured, and the engine's setting put back (its overlap untouched)."""
import random

from qwen35.bench import spec
from tests.test_spec_engine import make


def test_spec_rows_measure_what_the_drafts_got(tiny_dir):
    eng = make(tiny_dir, "auto")
    overlap, setting = eng.overlap, eng.speculation.setting
    out = spec.spec_rows(eng, [1, 3], spec.parse_ks("0,2,auto"), input_len=8, output_len=12, rng=random.Random(0))
    rows = out["spec"]
    assert [(r["batch"], r["k"]) for r in rows] == [(b, k) for b in (1, 3) for k in (0, 2, "auto")]
    for r in rows:
        if r["k"] == 0:
            assert r["tokens_per_step"] == 1.0 and r["drafted"] == 0 and r["acceptance"] is None
            assert r["vs_off"] == 1.0
        elif r["k"] == 2:
            assert r["drafted"] > 0 and 0.0 <= r["acceptance"] <= 1.0
        else:  # auto: k from the (placeholder) cost table, which may say 0 at a batch
            assert (r["acceptance"] is None) == (r["drafted"] == 0)
        assert r["ms_per_token"] > 0 and r["step_ms"] > 0
        # the steps while every request ran: all of them at k = 0 (the requests end together), fewer where drafts
        # let some requests end first
        assert 0 < r["full_steps"] <= r["steps"] and r["full_step_ms"] > 0 and r["full_tokens_per_step"] >= 1.0
        if r["k"] == 0:
            assert r["full_steps"] == r["steps"] and r["full_tokens_per_step"] == 1.0
        assert r["verify_graph_steps"] == 0  # (no CUDA graphs on the CPU)
        assert (r["verify_eager_steps"] > 0) == (r["drafted"] > 0)
    k2 = [r for r in rows if r["k"] == 2]
    assert all(r["tokens_per_step"] > 1.0 for r in k2)  # some synthetic drafts are accepted (acceptance ~0.6)
    three = next(r for r in k2 if r["batch"] == 3)
    assert three["full_steps"] < three["steps"]  # (three requests of 12 tokens at ~0.6: one ends before the others)
    assert 0.3 < out["acceptance"] <= 1.0
    assert (eng.overlap, eng.speculation.setting) == (overlap, setting)
    assert not eng.has_unfinished()


def test_parse_ks():
    assert spec.parse_ks("0, 1,auto") == [0, 1, "auto"]
