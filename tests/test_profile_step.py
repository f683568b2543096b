"""benchmarks/profile_step.py's trace reading on made-up events: kernels placed by the range that launched them,
graph kernels matched to the eager ones by name, per-kind layer tables and the parts outside the layers."""
from benchmarks import profile_step as ps


def _k(name, ts, dur, corr=None):
    e = {"cat": "kernel", "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_eager_kernels_take_the_innermost_range_of_their_launch():
    events = [
        {"cat": "user_annotation", "name": "model:embedding", "ts": 0, "dur": 5},
        {"cat": "user_annotation", "name": "L0:deltanet", "ts": 10, "dur": 20},
        {"cat": "user_annotation", "name": "L1:attention", "ts": 40, "dur": 20},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "args": {"correlation": 1}},
        {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 12, "args": {"correlation": 2}},
        {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 45, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 70, "args": {"correlation": 4}},
        _k("embed", 100, 2, 1), _k("gemv", 110, 3, 2), _k("attn", 120, 4, 3), _k("lm_head", 130, 5, 4),
    ]
    assert ps.label_eager(events) == [("embed", "model:embedding"), ("gemv", "L0:deltanet"),
                                      ("attn", "L1:attention"), ("lm_head", "other")]


def test_graph_steps_are_placed_by_name_and_summarised_per_kind():
    eager = [("embed", "model:embedding"), ("ar_norm_boundary", "L0:deltanet"), ("gemv", "L0:deltanet"),
             ("ar_norm_boundary", "L1:deltanet"), ("gemv", "L1:deltanet"), ("ar_norm_boundary", "L2:attention"),
             ("attn", "L2:attention"), ("lm_head", "model:lm_head")]
    # one replayed step: an extra input kernel first (the graph computes its inputs), then the eager sequence
    names = ["rows"] + [n for n, _ in eager]
    step, t = [_k("_step_marker", -5.0, 1.0)], 0.0
    for n in names:
        step.append(_k(n, t, 2.0))
        t += 3.0  # a 1 us gap after every kernel
    steps = ps.split_at_markers(step + [_k("_step_marker", t + 1000, 1.0), _k("rows", t + 1002, 2.0)])
    assert len(steps) == 2 and len(steps[0]) == len(names) and len(steps[1]) == 1
    step = step[1:]
    placed = ps.place_graph_kernels(steps[0], eager)
    assert [p for _, p, _, _ in placed] == ["other"] + [p for _, p in eager]
    assert placed[0][3] == 0.0 and all(abs(g - 1.0) < 1e-9 for _, _, _, g in placed[1:])
    s = ps.summarize([placed], {0: "deltanet", 1: "deltanet", 2: "attention"})
    d = s["kinds"]["deltanet"]
    assert d["layers_per_step"] == 2 and d["kernels_per_layer"] == 2
    assert [r["kernel"] for r in d["kernels"]] == ["ar_norm_boundary", "gemv"]
    assert d["comm_us"] == 2.0 and d["layer_us"] == 6.0 and d["gaps_us"] == 2.0
    assert s["kinds"]["attention"]["kernels_per_layer"] == 2
    assert s["kernels_per_step"] == len(names)
    assert abs(s["step_span_us"] - (len(names) * 3.0 - 1.0)) < 1e-9
    assert set(s["outside"]) == {"other rows", "model:embedding embed", "model:lm_head lm_head"}


def test_profile_mixed_host_plans():
    """benchmarks.profile_mixed_host's step specs and plans: prefill rows from position 0 with their tokens, decode
    rows one token at CONTEXT, every row with a table that holds its context."""
    from types import SimpleNamespace

    from benchmarks.profile_mixed_host import CONTEXT, make_plan, parse_step
    assert parse_step("prefill:2x64") == (0, 2, 64) and parse_step("mixed:8+1x64") == (8, 1, 64)
    plan = make_plan(SimpleNamespace(block_size=16), *parse_step("mixed:3+2x100"))
    assert plan.start_pos == [CONTEXT] * 3 + [0, 0]
    assert [len(t) for t in plan.token_ids] == [1, 1, 1, 100, 100]
    assert all(len(b) * 16 >= s + len(t) for b, s, t in zip(plan.block_tables, plan.start_pos, plan.token_ids))
    assert len({b for t in plan.block_tables for b in t}) == sum(map(len, plan.block_tables))  # no block shared


def test_cross_rank_times_and_spreads(monkeypatch):
    """Two simulated ranks replaying one step of two layers (gemv, pull), rank 0 with one more kernel at the end (the
    logits' concatenation): rank 1 runs each gemv 3 us longer, so rank 0 starts each pull 3 us earlier and both end
    it together: per kernel position, each rank's time and the spreads of the starts and ends, over the kernels
    both ran. Ranks whose common kernels differ in name give no table."""
    import torch
    other_names = {"on": False}

    def all_gather(x):  # rank 1's copy: one kernel fewer; its gemv 3 us longer, its pull 3 us shorter and later
        if x.dtype == torch.int64:
            if x.numel() == 1:  # the kernel counts
                return torch.stack([x, x - 1])
            return torch.stack([x, x + 1 if other_names["on"] else x])
        y = x.clone()
        y[0::2, 1] += 3.0
        y[1::2, 0] += 3.0
        y[1::2, 1] -= 3.0
        return torch.stack([x, y])

    monkeypatch.setattr(ps.parallel, "tp_size", lambda: 2)
    monkeypatch.setattr(ps.parallel, "is_driver", lambda: True)
    monkeypatch.setattr(ps.parallel, "all_gather", all_gather)
    step = [_k("gemv", 0.0, 5.0), _k("pull", 5.0, 8.0), _k("gemv", 13.0, 5.0), _k("pull", 18.0, 8.0),
            _k("cat", 30.0, 1.0)]
    placed = [[("gemv", "L0:deltanet", 5.0, 0.0), ("pull", "L0:deltanet", 8.0, 0.0),
               ("gemv", "L1:deltanet", 5.0, 0.0), ("pull", "L1:deltanet", 8.0, 0.0), ("cat", "other", 1.0, 4.0)]]
    x = ps.cross_rank([step], placed, {0: "deltanet", 1: "deltanet"}, device="cpu")
    rows = x["deltanet"]
    assert [r["kernel"] for r in rows] == ["gemv", "pull"]
    assert rows[0]["us_by_rank"] == [5.0, 8.0] and rows[0]["start_spread_us"] == 0.0
    assert rows[0]["end_spread_us"] == 3.0
    assert rows[1]["us_by_rank"] == [8.0, 5.0] and rows[1]["start_spread_us"] == 3.0
    assert rows[1]["end_spread_us"] == 0.0
    other_names["on"] = True
    assert ps.cross_rank([step], placed, {0: "deltanet", 1: "deltanet"}, device="cpu") is None
