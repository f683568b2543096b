"""benchmarks.score_model: the closed-loop replay of the users' throughput workload on a record's step times."""
import json

import pytest

from benchmarks import score_model


def test_step_time_is_linear_between_recorded_sizes_and_flat_beyond():
    curve = [(1, 2.0), (8, 4.0), (64, 10.0)]
    assert score_model.step_ms(curve, 1) == 2.0
    assert score_model.step_ms(curve, 4) == pytest.approx(2.0 + 2.0 * 3 / 7)
    assert score_model.step_ms(curve, 36) == pytest.approx(7.0)
    assert score_model.step_ms(curve, 100) == 10.0


def test_replay_at_one_stream_is_every_token_at_batch_one():
    curve = [(1, 2.0), (64, 5.0)]
    assert score_model.replay_s(curve, [3, 5, 1], 1) == pytest.approx(9 * 2.0 / 1e3)


def test_replay_admits_the_next_request_as_one_ends():
    # c = 2: [3, 1, 2] -> steps with 2 running (3 and 1), then (2 left of the first and the new 2) 2, 2: 3 steps at
    # batch 2 then none left: the first ends after 3, the third after 1 + 2 = 3
    curve = [(1, 1.0), (2, 10.0)]
    assert score_model.replay_s(curve, [3, 1, 2], 2) == pytest.approx(3 * 10.0 / 1e3)
    # the queue never empties the batch early: [4, 1, 1, 1] at c = 2 is 4 steps at batch 2
    assert score_model.replay_s(curve, [4, 1, 1, 1], 2) == pytest.approx(3 * 10.0 / 1e3 + 1.0 / 1e3)


def test_score_weights_the_levels_and_reproduces_a_fitted_run(tmp_path, capsys, monkeypatch):
    lengths = [5, 1, 3, 2] * 16
    curve = [(1, 1.0), (64, 2.0)]
    walls = {c: score_model.replay_s(curve, lengths, c) + 0.5 for c in score_model.LEVELS}
    total, levels = score_model.score(curve, lengths, {c: 0.5 for c in walls}, prompt_tokens=1000)
    tokens = 1000 + sum(lengths)
    assert total == pytest.approx(sum(w * tokens / walls[c] for c, w in score_model.LEVELS.items()))
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"decode": [{"batch": b, "step_ms": t} for b, t in curve]}))
    run = tmp_path / "t.json"
    run.write_text(json.dumps({"meta": {"settings": {"output_lengths": lengths}},
                               "levels": [{"concurrency": c, "wall_s": w, "prompt_tokens": 1000}
                                          for c, w in walls.items()]}))
    monkeypatch.setattr("sys.argv", ["score_model", "--record", str(record), "--throughput", str(run)])
    score_model.main()
    assert f"modelled weighted score {total:,.0f}" in capsys.readouterr().out


def test_replicas_step_their_own_requests_side_by_side():
    """Two engines at c = 2: one request each, each at batch 1's step time, side by side (one engine: batch 2's);
    at c = 1 the second engine never runs two at once, so the replay is one engine's; uneven lengths: the wall is
    the longer engine's, and a freed engine takes the next request."""
    curve = [(1, 2.0), (8, 10.0)]
    assert score_model.replay_s(curve, [3, 3], 2, replicas=2) == pytest.approx(3 * 2.0 / 1e3)
    assert score_model.replay_s(curve, [3, 3], 2) == pytest.approx(3 * (2.0 + 8.0 / 7) / 1e3)
    assert score_model.replay_s(curve, [3, 5, 1], 1, replicas=2) == pytest.approx(
        score_model.replay_s(curve, [3, 5, 1], 1))
    # engine A runs 4, engine B runs 1 then 1 then 1: walls 4 x 2.0 and 3 x 2.0
    assert score_model.replay_s(curve, [4, 1, 1, 1], 2, replicas=2) == pytest.approx(4 * 2.0 / 1e3)
