"""create_engine as a runtime (issue #29 items 2 and 3), on the CPU: the warm-up it runs on a GPU leaves every
request as if it had never run; a decode call maps request ids to rows in any order, and the rows a decode graph pads
with (a call of 3 runs the graph of 4) touch no live request; a call sends a block table only when it grew.

The decode graphs are stood in for by eager replays of the same rows (DecodeGraphs' copy of the rows, its padding
and its choice of size are what runs; the forward is the torch one), so that the row mapping and the padding run on
the CPU. fp32: max |logit diff| <= 1e-5 between a padded and an unpadded run of the same calls (the same ops on
the same rows; only the batch differs), <= 1e-4 against transformers (as tests/test_llama.py).
"""
import json
import os
import random

import pytest
import torch

import qwen35.api as api
from qwen35.api import create_engine
from qwen35.cuda_graphs import DecodeGraphs, capture_sizes, decode_batch
from qwen35.runner import ModelRunner
from tests.hf_reference import hf_decode_logits
from tests.test_llama import CONFIGS, build_hf, random_ids

TOL_HF, TOL_SELF = 1e-4, 1e-5
BLOCK = 4


@pytest.fixture(scope="module")
def qwen2_pt(tmp_path_factory):
    kind, kw = CONFIGS["qwen2-gqa3-linear"]
    hf = build_hf(kind, kw, seed=3)
    path = str(tmp_path_factory.mktemp("qwen2-pt"))
    torch.save(hf.state_dict(), os.path.join(path, "model.pt"))
    return hf, path, json.loads(hf.config.to_json_string())


class EagerReplay:
    """A decode graph's stand-in: replay() runs the forward over the graph's static rows into its output."""

    def __init__(self, graphs: "CpuDecodeGraphs", size: int):
        self.graphs, self.size = graphs, size
        runner = graphs.runner
        self.out = torch.zeros(size, runner.config.hidden_size, dtype=runner.dtype)

    def replay(self) -> None:
        runner = self.graphs.runner
        self.out.copy_(runner.model(decode_batch(runner, *self.graphs.rows[:, :self.size])))
        self.graphs.replayed.append(self.size)


class CpuDecodeGraphs(DecodeGraphs):
    def __init__(self, runner: ModelRunner, sizes: list[int] | None = None):  # DecodeGraphs' fields, without CUDA
        self.runner, self.tails, self.size, self.replayed = runner, {}, 0, []
        self.rows = self._padded_rows()
        sizes = sizes or capture_sizes(runner.max_num_seqs)
        self.graphs = {b: (g, g.out) for b in sizes for g in [EagerReplay(self, b)]}
        self._size_for = [min(s for s in self.graphs if s >= n) for n in range(max(self.graphs) + 1)]


def test_warm_up_runs_in_create_engine_and_leaves_requests_untouched(qwen2_pt, monkeypatch):
    hf, path, cfg = qwen2_pt
    ran = []
    real = ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, n: ran.append(n) or real(self, n))
    monkeypatch.setattr(api, "needs_warm_up", lambda runner: True)  # (a GPU's answer)
    eng = create_engine(cfg, path, device="cpu", max_num_seqs=5, block_size=BLOCK, max_num_batched_tokens=40)
    assert ran == [40] and eng.creation_s > 0
    assert eng.runner.warm_up_plans(40)  # the warm-up had steps to run
    create_engine(cfg, path, device="cpu", max_num_seqs=2, warm_up=False)
    assert ran == [40]  # (warm_up=False: none)
    # what the warm-up wrote (slots and blocks from 0, decode rows fed from the device) is not seen by requests
    a, b = random_ids(1000, 9, 1), random_ids(1000, 22, 2)
    ref_a, ref_b = hf_decode_logits(hf, a, [5, 6, 7]), hf_decode_logits(hf, b, [8, 9])
    out = eng.prefill(["a", "b"], [torch.tensor(a), torch.tensor(b)])
    assert (out - torch.stack([ref_a[0], ref_b[0]])).abs().max() <= TOL_HF
    out = eng.decode(["b", "a"], torch.tensor([8, 5]))
    assert (out - torch.stack([ref_b[1], ref_a[1]])).abs().max() <= TOL_HF
    out = eng.decode(["a", "b"], [6, 9])
    assert (out - torch.stack([ref_a[2], ref_b[2]])).abs().max() <= TOL_HF
    with pytest.raises(RuntimeError, match="before any request"):
        eng.warm_up(8)


def record_plans(eng) -> list:
    """The plans the engine's runner executes from now on, in order (the calls still run)."""
    plans, real = [], eng.runner.execute
    eng.runner.execute = lambda plan, **kw: plans.append(plan) or real(plan, **kw)
    return plans


def test_warm_up_without_graphs_runs_a_decode_step_of_every_size(qwen2_pt):
    _, path, cfg = qwen2_pt
    eng = create_engine(cfg, path, device="cpu", max_num_seqs=6, block_size=BLOCK)
    plans = record_plans(eng)
    done = eng.warm_up(16)
    decode = sorted(p.num_seqs for p in plans if p.is_pure_decode)
    assert decode == capture_sizes(6) == [1, 2, 3, 4, 5, 6] and done["logits_shapes"] == 6
    assert done["steps"] == len(plans) - len(decode) > 0


def test_decode_rows_in_any_order_and_padded_rows_touch_no_request(qwen2_pt):
    """Two engines on the same weights make the same calls: one through the decode graphs' rows (calls of 3 and 5
    requests run padded to 4 and 6), one eager (never padded). Requests are decoded in shuffled order and subsets,
    one removed and another prefilled into its slot midway; every call's logits agree."""
    hf, path, cfg = qwen2_pt
    padded, plain = (create_engine(cfg, path, device="cpu", max_num_seqs=6, block_size=BLOCK) for _ in range(2))
    padded.runner.graphs = graphs = CpuDecodeGraphs(padded.runner, [1, 2, 4, 6])  # (sizes with gaps, as past 32)
    rng = random.Random(0)
    prompts = {f"r{i}": random_ids(1000, n, 10 + i) for i, n in enumerate([3, 11, 4, 17, 8])}
    ids = list(prompts)
    for eng in (padded, plain):
        eng.prefill(ids, [torch.tensor(prompts[r]) for r in ids])
    fed = {r: [] for r in ids}
    for step in range(18):
        if step == 9:  # a slot freed and taken by a new request, mid-trace, out of order
            for eng in (padded, plain):
                eng.remove(["r1"])
                eng.prefill(["r5"], [torch.tensor(random_ids(1000, 6, 30))])
            ids, prompts["r5"] = [r for r in ids if r != "r1"] + ["r5"], random_ids(1000, 6, 30)
            fed["r5"] = []
        rows = rng.sample(ids, rng.choice([1, 3, 5, len(ids)]))
        tokens = [rng.randrange(1000) for _ in rows]
        a, b = padded.decode(rows, torch.tensor(tokens)), plain.decode(rows, torch.tensor(tokens))
        assert a.shape == (len(rows), 1000) and (a - b).abs().max() <= TOL_SELF, step
        for r, t in zip(rows, tokens):
            fed[r].append(t)
    assert {4, 6} <= set(graphs.replayed) and 1 in graphs.replayed  # padded calls ran, and unpadded ones
    for r in ("r0", "r3", "r5"):  # and both are the model transformers runs
        last = padded.decode([r], torch.tensor([1]))[0]
        assert (last - hf_decode_logits(hf, prompts[r], fed[r] + [1])[-1]).abs().max() <= TOL_HF


def test_a_call_sends_a_block_table_only_when_it_grew(qwen2_pt):
    _, path, cfg = qwen2_pt
    eng = create_engine(cfg, path, device="cpu", max_num_seqs=2, block_size=BLOCK)
    plans = record_plans(eng)
    eng.prefill(["a", "b"], [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])])  # 1 and 2 blocks of 4
    for t in range(6):
        eng.decode(["b", "a"], [t, t])
    sent = [[len(t) for t in p.block_tables] for p in plans]
    # rows (b, a): a holds 3 tokens, then 4..9 (a new block at 5 and at 9); b 5, then 6..11 (a new one at 9)
    assert sent == [[1, 2], [0, 0], [0, 2], [0, 0], [3, 0], [0, 0], [0, 3]]
    assert all(p.token_ids == [[], []] for p in plans[1:])  # decode tokens go to the slots on the device
    # a prompt that fills its last block takes the next one at its prefill: the first decode call sends no table
    eng.remove(["a", "b"])
    plans.clear()
    eng.prefill(["c"], [torch.tensor([1, 2, 3, 4])])
    for t in range(5):
        eng.decode(["c"], [t])
    assert [[len(t) for t in p.block_tables] for p in plans] == [[2], [0], [0], [0], [0], [3]]


def test_bad_token_ids_are_refused_and_the_engine_goes_on(qwen2_pt):
    """Ids outside [0, vocab) or not integers are refused with a ValueError naming them, before anything is admitted
    (on a GPU they would index past the embedding inside a kernel and end the process); the engine then gives the
    logits of an engine that never saw them."""
    _, path, cfg = qwen2_pt
    eng, clean = (create_engine(cfg, path, device="cpu", max_num_seqs=2, block_size=BLOCK) for _ in range(2))
    for bad, match in (([1, 1000], "token id 1000 is outside the vocabulary"), ([-1], "token id -1"),
                       ([1.5], "must be integers")):
        with pytest.raises(ValueError, match=match):
            eng.prefill(["a"], [torch.tensor(bad)])
    assert not eng._state and eng.slots.num_free == clean.slots.num_free
    a, b = eng.prefill(["a"], [torch.tensor([1, 2, 3])]), clean.prefill(["a"], [torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="token id 1000"):
        eng.decode(["a"], torch.tensor([1000]))
    with pytest.raises(ValueError, match="token id 1000"):  # a bad re-prefill leaves the live request as it was
        eng.prefill(["a"], [torch.tensor([5, 1000])])
    a, b = eng.decode(["a"], torch.tensor([7])), clean.decode(["a"], torch.tensor([7]))
    assert (a - b).abs().max() <= TOL_SELF
