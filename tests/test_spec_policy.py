"""`--speculative-tokens auto` (scheduler/speculation.py): k from the batch size, the running acceptance and the
cost table. Host-only arithmetic, no model.

- a table where a step of n tokens costs what a step of one does (the fixed cost dominates): auto speculates (k > 0)
  at batch 1 with acceptance 0.6, and picks the most drafts it may (AUTO_MAX_K) at acceptance 0.95;
- a table where cost grows linearly with the tokens (nothing is shared): auto picks 0 at every batch and acceptance
  (a verify step of k + 1 tokens costs k + 1 plain steps and emits fewer tokens);
- the placeholder: k > 0 at batch 1, acceptance 0.6; 0 at acceptance 0.05; the measured tables that ship load, by
  GPU name and TP, and another GPU kind or TP has none;
- the running acceptance follows what verify steps report (record), and comes back to the prior while auto keeps
  choosing 0 (the evidence fades); with the shipped TP=1 H200 table and drafts accepted at random at 0.6, k stays
  put at batch 1, 2 and 64 (a k change makes a verify step run outside the graphs; per step, batch 1's noisy 0-or-1
  outcomes had flipped k 184 times in 2,000 steps); with drafts never accepted (random weights) auto verifies on few
  steps at any batch (the average it replaced, pulled back to the prior by 10% a plain step, verified on 83% of
  steps at batch 1); a fixed K is returned as it is; bad settings are clear errors; a bench results JSON is a
  table.
"""
import json

import pytest

from scheduler.speculation import (ACCEPTANCE_PRIOR, AUTO_MAX_K, CostTable, SpecPolicy, model_shape,
                                   parse_speculative_tokens, per_draft_acceptance)

# a step costs the same whatever its k (the fixed cost dominates), or k + 1 plain steps (nothing is shared)
FLAT = CostTable({k: [(1, 1.0), (1024, 1.0)] for k in range(AUTO_MAX_K + 1)}, "flat")
LINEAR = CostTable({k: [(1, k + 1.0), (1024, 1024.0 * (k + 1))] for k in range(AUTO_MAX_K + 1)}, "linear")


def policy(table, acceptance):
    p = SpecPolicy("auto", table)
    p.assume(acceptance)
    return p


def test_auto_speculates_where_it_pays_and_not_where_it_loses():
    assert policy(FLAT, 0.6).next_k(1) > 0
    assert policy(FLAT, 0.95).next_k(1) == AUTO_MAX_K
    for batch in (1, 8, 64):
        for a in (0.3, 0.6, 0.9):
            assert policy(LINEAR, a).next_k(batch) == 0, (batch, a)
    assert policy(CostTable.placeholder(), 0.6).next_k(1) > 0
    assert policy(CostTable.placeholder(), 0.05).next_k(1) == 0


def test_running_acceptance():
    p = SpecPolicy("auto", FLAT)
    for _ in range(200):
        p.record(drafted=8, accepted=8, k=2)  # every draft accepted
    # (the prior's 10 drafts at 0.6 stay in: ~104 drafts of evidence at 8 a step)
    assert p.acceptance > 0.96 and p.drafted == 1600 and p.accepted == 1600
    for _ in range(200):
        p.record(drafted=8, accepted=0, k=2)
    assert p.acceptance < 0.06
    assert abs(per_draft_acceptance((0.5 + 0.25) / 2, 2) - 0.5) < 1e-6  # k = 2 at a = 0.5: 0.75 of 2 accepted
    lin = policy(LINEAR, 0.0)
    for _ in range(2000):
        assert lin.next_k(1) == 0
    assert abs(lin.acceptance - ACCEPTANCE_PRIOR) < 1e-3  # the evidence faded: speculation gets tried again


def test_fixed_k_and_settings(tmp_path):
    assert SpecPolicy(2).next_k(64) == 2 and not SpecPolicy(0).enabled
    assert parse_speculative_tokens("3") == 3 and parse_speculative_tokens("auto") == "auto"
    for bad in ("-1", "two", 99, True):
        with pytest.raises(ValueError, match="--speculative-tokens"):
            parse_speculative_tokens(bad)
    path = tmp_path / "table.json"
    rows = [{"batch": b, "k": k, "step_ms": 5.0 * b} for b in (1, 64) for k in (0, 2)] + [{"batch": 1, "k": "auto",
                                                                                            "step_ms": 1.0}]
    path.write_text(json.dumps({"device": "x", "spec": rows}))
    table = CostTable.from_json(str(path))
    assert table.step_ms(32, 2) == 5.0 * 32 and table.step_ms(128, 0) == 5.0 * 64  # linear, flat past the last
    assert table.ms_per_token(1, 1, 0.6) == float("inf")  # a k not measured is never chosen
    assert policy(table, 0.6).next_k(1) == 2
    # a row's cost: as if it had emitted E(k) tokens a step at the acceptance it measured (its ms per token back)
    measured = {"batch": 1, "k": 2, "step_ms": 6.0, "tokens_per_step": 1.5, "acceptance": 0.5}
    t2 = CostTable.from_rows([{"batch": 1, "k": 0, "step_ms": 2.0, "tokens_per_step": 1.0}, measured], "m")
    a = per_draft_acceptance(0.5, 2)
    assert abs(t2.ms_per_token(1, 2, a) - 4.0) < 1e-6 and t2.ms_per_token(1, 0, a) == 2.0
    # where a row has them, the steps while all its requests ran set the cost (the run's end left out)
    full = dict(measured, full_step_ms=5.0, full_tokens_per_step=1.75)
    t3 = CostTable.from_rows([{"batch": 1, "k": 0, "step_ms": 2.0, "tokens_per_step": 1.0}, full], "m")
    assert abs(t3.ms_per_token(1, 2, a) - 5.0 / 1.75) < 1e-6
    path.write_text(json.dumps({"points": [[1, 5.0]]}))
    with pytest.raises(ValueError, match="qwen35.bench --mode spec"):
        CostTable.from_json(str(path))
    path.write_text(json.dumps({"spec": [r for r in rows if r["k"] != 0]}))
    with pytest.raises(ValueError, match="k = 0"):
        CostTable.from_json(str(path))


def flagship_shape() -> dict:
    """model_shape of Qwen3.5-35B-A3B (its synthetic preset's config), the model every shipped table measured."""
    from qwen35.config import ModelConfig
    from qwen35.synth import PRESETS
    return model_shape(ModelConfig.from_dict(dict(PRESETS["qwen3.5-35b-a3b"])))


def test_shipped_tables():
    """The measured tables ship per model, GPU kind and TP; another device, TP or model gets none (the engine then
    measures one at start on GPUs, or takes the placeholder: tests/test_spec_engine.py)."""
    import json as _json
    from scheduler.speculation import SHIPPED
    flagship = flagship_shape()
    for t in _json.load(open(SHIPPED))["tables"]:
        assert t["model"] == flagship
        table = CostTable.shipped(t["device"], t["tp"], flagship)
        assert t["device"] in table.source and table.steps[0][0][0] == 1
        assert {r["k"] for r in t["spec"]} >= {0, 1}
        assert CostTable.shipped(t["device"], t["tp"], {**flagship, "num_hidden_layers": 24}) is None
    assert CostTable.shipped("a GPU never measured", 8, flagship) is None
    assert CostTable.shipped("NVIDIA H200", 4, flagship) is None  # (its table predated the faster verify steps)


def test_auto_keeps_k_at_small_batch_under_random_acceptance():
    import random
    table = CostTable.shipped("NVIDIA H200", 1, flagship_shape())
    for batch in (1, 2, 64):
        rng, p = random.Random(batch), SpecPolicy("auto", table)
        k, flips = p.next_k(batch), 0
        for _ in range(2000):
            if k:
                accepted = 0
                for _ in range(batch):  # each row: its drafts accepted while they keep being accepted
                    j = 0
                    while j < k and rng.random() < 0.6:
                        j += 1
                    accepted += j
                p.record(batch * k, accepted, k)
            nxt = p.next_k(batch)
            flips += nxt != k
            k = nxt
        assert flips <= 5 and k > 0, (batch, flips, k)


@pytest.mark.parametrize("tp", [1, 2])
def test_auto_rarely_verifies_drafts_that_are_never_accepted(tp):
    """Random weights: no draft is ever accepted. auto tries, stops within a few verify steps, and tries again
    rarely: at most 1.5% of 2,000 steps verify at batch 1, 2, 8 and 64 (the shipped H200 tables; without the retry's
    doubling TP=2's batch-1 steps verified 84 times)."""
    table = CostTable.shipped("NVIDIA H200", tp, flagship_shape())
    for batch in (1, 2, 8, 64):
        p = SpecPolicy("auto", table)
        k, verified = p.next_k(batch), 0
        for _ in range(2000):
            if k:
                p.record(batch * k, 0, k)
                verified += 1
            k = p.next_k(batch)
        assert verified <= 30, (batch, verified)


def test_retries_wait_longer_after_each_switch_off_and_resume_when_drafts_are_accepted():
    """Drafts never accepted: each retry comes at least as late as the one before, the wait doubling
    RETRY_DOUBLINGS times; once drafts are accepted again, speculation stays on and the
    switch-offs are counted from 0."""
    from scheduler.speculation import RETRY_DOUBLINGS
    p = SpecPolicy("auto", CostTable.shipped("NVIDIA H200", 2, flagship_shape()))
    k, retries = p.next_k(1), []
    for step in range(20000):
        if k:
            p.record(k, 0, k)
            retries.append(step)
        k = p.next_k(1)
    gaps = [b - a for a, b in zip(retries, retries[1:]) if b - a > 1]  # (a retry may verify two steps in a row)
    assert len(gaps) >= 6 and all(b >= a - 1 for a, b in zip(gaps, gaps[1:])), gaps
    # (the first gap follows the first switch-off, already one doubling in; then it stops growing)
    assert gaps[-1] >= 2 ** (RETRY_DOUBLINGS - 1) * gaps[0] * 0.9 and abs(gaps[-1] - gaps[-3]) <= 1, gaps
    while not k:  # drafts accepted from now on: the next retry finds them
        k = p.next_k(1)
    for _ in range(50):
        p.record(k, k, k)
        k = p.next_k(1)
        assert k > 0
    assert p.misses == 0


def test_switch_offs_by_the_batch_do_not_delay_retries():
    """Drafts accepted a little below the prior's rate, the batch moving between 1 (speculation pays) and 8 (in this
    table it does not, whatever the acceptance: a verify step of one draft costs 2.25 plain ones): auto switches off
    at every batch of 8, and none of those counts as a miss."""
    import random
    table = CostTable({0: [(1, 2.0), (8, 4.0)], 1: [(1, 2.7), (8, 9.0)]}, "speculation never pays at batch 8")
    rng, p = random.Random(0), SpecPolicy("auto", table)
    ks = []
    for step in range(400):
        batch = 1 if (step // 20) % 2 == 0 else 8
        k = p.next_k(batch)
        ks.append((batch, k))
        if k:  # each draft accepted at 0.5 while the ones before it were: below the prior, above batch 1's break-even
            accepted = sum(next((j for j in range(k) if rng.random() >= 0.5), k) for _ in range(batch))
            p.record(batch * k, accepted, k)
        assert p.misses == 0, (step, p.acceptance)
    assert {k for b, k in ks if b == 8} == {0} and all(k > 0 for b, k in ks[5:20] if b == 1)
