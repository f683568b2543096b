"""Prefill CUDA graphs of dense models (qwen35/prefill_graphs.py): the buckets, the padded rows, a padded step's real
rows against the eager step (CPU, fp32, the same batch builder the graphs capture), and on a GPU the replayed
prefill calls against eager ones."""
from __future__ import annotations

import json

import pytest
import torch

from qwen35.api import create_engine
from qwen35.prefill_graphs import padded_rows, prefill_batch, prefill_buckets
from scheduler.plan import StepPlan
from tests.test_llama import BLOCK, CONFIGS, build_hf, random_ids


def test_buckets_grow_by_at_most_half_and_cover_the_limit():
    for limit in (1, 256, 257, 3000, 16384, 20000):
        sizes = prefill_buckets(limit)
        assert sizes[0] == 256 and sizes[-1] >= limit and (len(sizes) == 1 or sizes[-2] < limit)
        assert all(b <= a * 3 // 2 and b > a for a, b in zip(sizes, sizes[1:]))


def test_padded_rows_layout():
    """Real rows first, then padding sequences of the pad slot (at most pad_len tokens each), then empty ones;
    None when the padding needs more sequences than are left."""
    rows = padded_rows([3, 1], [0, 4], [[7, 8, 9], [5]], n=12, seqs=5, pad_slot=9, pad_len=5)
    S = 5
    assert rows[:S] == [3, 1, 9, 9, 9]
    assert rows[S:2 * S] == [0, 4, 0, 0, 0]
    assert rows[2 * S:3 * S + 1] == [0, 3, 4, 9, 12, 12]  # padding of 8 tokens: 5 + 3, then one empty sequence
    assert rows[3 * S + 1:] == [7, 8, 9, 5] + [0] * 8
    assert padded_rows([3, 1], [0, 4], [[7, 8, 9], [5]], n=4, seqs=3, pad_slot=9, pad_len=5)[6:10] == [0, 3, 4, 4]
    assert padded_rows([3, 1], [0, 4], [[7, 8, 9], [5]], n=16, seqs=4, pad_slot=9, pad_len=5) is None  # 3 pads
    assert padded_rows([3], [0], [[7, 8, 9]], n=2, seqs=4, pad_slot=9, pad_len=5) is None  # too many tokens


@torch.inference_mode()
def test_padded_step_equals_the_eager_step_on_real_rows(tmp_path):
    """The batch the graphs capture (prefill_batch over padded rows: two padding sequences, empty ones after) gives
    the real rows' final hidden states of the eager step (fp32, the fast kernels through the interpreter), and the
    KV it caches for them."""
    kind, kw = CONFIGS["llama-gqa5-tied-yarn"]
    hf = build_hf(kind, kw, seed=3)
    hf.save_pretrained(str(tmp_path))
    cfg = json.loads(hf.config.to_json_string())
    outs = []
    for padded in (False, True):
        eng = create_engine(cfg, str(tmp_path), device="cpu", max_num_seqs=3, block_size=BLOCK, max_model_len=64,
                            kernels="fast")
        runner = eng.runner
        prompts = [random_ids(cfg["vocab_size"], 21, 1), random_ids(cfg["vocab_size"], 9, 2)]
        for rid, p in zip("ab", prompts):  # the requests' slots and blocks, as a prefill call takes them
            eng._state[rid] = {"slot": eng.slots.allocate()[0], "blocks": [], "len": 0}
            eng._grow(rid, len(p))
        states = [eng._state[r] for r in "ab"]
        plan = StepPlan(state_slots=[s["slot"] for s in states], token_ids=prompts, start_pos=[0, 0],
                        block_tables=[list(s["blocks"]) for s in states], want_logits=[True, True])
        if padded:
            runner._set_tables(plan)
            S, n = runner.max_num_seqs + 1, 96
            pad_len = 40  # (< the scratch table's reach, so that the padding takes two sequences)
            rows = padded_rows(plan.state_slots, plan.start_pos, prompts, n, S, runner.scratch_slot, pad_len)
            assert rows[2 * S:3 * S + 1] == [0, 21, 30, 70, 96]
            hidden = runner.model(prefill_batch(runner, torch.tensor(rows), n, S))
        else:
            hidden = runner.model(runner.prepare(plan))
        kv = [m.k_cache[states[0]["blocks"][0]].clone() for m in runner.attn_layers]
        outs.append((hidden[[20, 29]], kv))
    assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(outs[0][1], outs[1][1]))


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_prefill_calls_replay_graphs_and_match_eager(tmp_path):
    """create_engine on a GPU captures the prefill graphs; prefill calls of 1-3 prompts (one long enough for several
    padding sequences) replay them and give the eager step's logits within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    kind, kw = CONFIGS["llama-gqa5-tied-yarn"]
    hf = build_hf(kind, kw, seed=4).to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path))
    cfg = json.loads(hf.config.to_json_string())
    eng = create_engine(cfg, str(tmp_path), device="cuda", max_num_seqs=3, block_size=BLOCK, max_model_len=128,
                        max_num_batched_tokens=400)
    runner = eng.runner
    assert runner.prefill_graphs is not None and sorted(runner.prefill_graphs.graphs) == [256, 384, 512]
    vocab = cfg["vocab_size"]
    for lens in ([5], [100, 37], [128, 128, 60], [1, 1, 1]):
        prompts = [torch.tensor(random_ids(vocab, n, n + i)) for i, n in enumerate(lens)]
        ids = [f"r{i}" for i in range(len(lens))]
        replays = runner.prefill_graphs.replays
        got = eng.prefill(ids, prompts)
        held = lens != [1, 1, 1]  # (3 rows and 253 padding tokens would need 2 padding sequences: 5 > 4, eager)
        assert runner.prefill_graphs.replays == replays + held
        graphs, runner.prefill_graphs = runner.prefill_graphs, None  # the same call eagerly
        want = eng.prefill(ids, prompts)
        runner.prefill_graphs = graphs
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (lens, (got - want).abs().max().item())
        eng.remove(ids)
