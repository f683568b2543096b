"""The torch forward against transformers (Qwen3_5MoeForCausalLM / Qwen3_5ForCausalLM) on the same random weights.

Tolerance: max |logit difference| <= 1e-4 in fp32 (logits are O(1)); the packed/chunked/TP variants of our own
forward must agree with the plain one to 1e-5.
"""

import pytest
import torch

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.hf_reference import build_hf_model, caches, from_same_caches, hf_decode_logits, run_tp

TOL_HF = 1e-4
TOL_SELF = 1e-5
BLOCK = 16


@pytest.fixture(scope="module", params=["moe", "dense"])
def reference(request, tmp_path_factory):
    model = build_hf_model(request.param)
    path = str(tmp_path_factory.mktemp(f"hf-{request.param}"))
    model.save_pretrained(path)  # a checkpoint written by transformers itself
    return request.param, model, path


def make_runner(path, **kw):
    return ModelRunner(ModelConfig.from_dir(path), EngineArgs(model=path, device="cpu", dtype="float32",
                                                              block_size=BLOCK, max_num_seqs=8, max_model_len=512,
                                                              **kw), path)


def blocks_for(seq: int, length: int) -> list[int]:
    """Disjoint block ids per sequence, deliberately not starting at 0 nor contiguous across sequences."""
    n = (length + BLOCK - 1) // BLOCK
    return [3 + seq + 8 * j for j in range(n)]


def all_logits(runner, plan):
    batch = runner.prepare(plan)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch))


def test_prefill_matches_transformers(reference):
    _, hf, path = reference
    runner = make_runner(path)
    ids = torch.randint(0, 1024, (70,), generator=torch.Generator().manual_seed(1)).tolist()  # crosses 64-chunk
    ours = all_logits(runner, StepPlan([2], [ids], [0], [blocks_for(0, 70)], [True]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 0.1  # a non-trivial function
    assert (ours - ref).abs().max().item() <= TOL_HF


def test_prefill_then_decode_matches_transformers(reference):
    _, hf, path = reference
    runner = make_runner(path)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 1024, (67,), generator=gen).tolist()
    steps = torch.randint(0, 1024, (32,), generator=gen).tolist()
    assert worst_decode_error(runner, hf, prompt, steps) <= TOL_HF


def worst_decode_error(runner, hf, prompt: list[int], steps: list[int]) -> float:
    """Max |logit diff| against transformers over the prompt's last token and each token fed one at a time."""
    ref = hf_decode_logits(hf, prompt, steps)
    table = blocks_for(1, len(prompt) + len(steps))
    got = [runner.execute(StepPlan([5], [prompt], [0], [table], [True]))[0]]
    for i, t in enumerate(steps):
        got.append(runner.execute(StepPlan([5], [[t]], [len(prompt) + i], [table], [True]))[0])
    return max((a.cpu() - b).abs().max().item() for a, b in zip(got, ref))


def test_packed_batch_equals_each_alone(reference):
    _, _, path = reference
    runner = make_runner(path)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 70, 1, 33]
    seqs = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]
    alone = [runner.execute(StepPlan([i], [s], [0], [blocks_for(i, len(s))], [True]))[0] for i, s in enumerate(seqs)]
    slots = [4, 0, 6, 1]  # any slot may hold any sequence
    packed = runner.execute(StepPlan(slots, seqs, [0] * 4, [blocks_for(i, len(s)) for i, s in enumerate(seqs)],
                                     [True] * 4))
    for i in range(4):
        assert (packed[i] - alone[i]).abs().max().item() <= TOL_SELF
    # then a mixed step: two decodes and a continuing prefill chunk, against the same done one at a time
    nxt = [[7], [9], [1, 2, 3, 4, 5, 6]]
    mixed = runner.execute(StepPlan([slots[0], slots[2], slots[3]], nxt, [5, 1, 33],
                                    [blocks_for(0, 6), blocks_for(2, 2), blocks_for(3, 39)], [True] * 3))
    for j, (i, toks) in enumerate(zip([0, 2, 3], nxt)):
        runner.execute(StepPlan([7], [seqs[i]], [0], [blocks_for(7, len(seqs[i]) + len(toks))], [False]))
        solo = runner.execute(StepPlan([7], [toks], [len(seqs[i])], [blocks_for(7, len(seqs[i]) + len(toks))], [True]))
        assert (mixed[j] - solo[0]).abs().max().item() <= TOL_SELF


def test_chunked_prefill_equals_whole(reference):
    _, _, path = reference
    runner = make_runner(path)
    ids = torch.randint(0, 1024, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    table = blocks_for(0, 100)
    whole = runner.execute(StepPlan([0], [ids], [0], [table], [True]))[0]
    pos = 0
    for size in (30, 1, 2, 64, 3):  # chunk sizes that are not block-aligned
        out = runner.execute(StepPlan([1], [ids[pos:pos + size]], [pos], [table], [pos + size == 100]))
        pos += size
    assert (out[0] - whole).abs().max().item() <= TOL_SELF


def assert_tp_equals_tp1(path, world: int, kernels: str, seed: int, tmp_path) -> None:
    """A prefill, a decode step and a mixed step at TP=world over gloo give TP=1's logits."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (70, 9)]
    tables = [blocks_for(0, 72), blocks_for(1, 11)]
    plans = [StepPlan([0, 1], seqs, [0, 0], tables, [True, True]),
             StepPlan([0, 1], [[5], [6]], [70, 9], tables, [True, True]),
             StepPlan([1, 0], [[8, 9], [7]], [10, 71], [tables[1], tables[0]], [True, True])]
    runner = make_runner(path, kernels=kernels)
    single = [runner.execute(p) for p in plans]
    for a, b in zip(single, run_tp(world, make_runner, path, plans, kernels, str(tmp_path / f"tp{world}.pt"))):
        assert a.shape == b.shape and a.abs().max() > 0.1
        assert (a - b).abs().max().item() <= TOL_SELF


@pytest.mark.parametrize("kernels", ["torch", "fast"])  # fast: the Triton kernels through the interpreter
def test_tensor_parallel_2_equals_1(reference, tmp_path, kernels):
    assert_tp_equals_tp1(reference[2], 2, kernels, 5, tmp_path)


# heads, experts' rows and vocabulary that split 8 ways (the release model's TP=8: one query head, one DeltaNet key
# head and two value heads per rank, the 2 KV heads replicated, every expert cut to 1/8 of its rows)
WIDE = dict(num_attention_heads=8, head_dim=16, linear_num_key_heads=8, linear_num_value_heads=16,
            moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.mark.parametrize("world,kernels", [(8, "torch"), (4, "fast")])
def test_tensor_parallel_4_and_8_equal_1(tmp_path, world, kernels):
    """The engine's splits at the users' degree (8 ranks over gloo, torch kernels) and at 4 (the Triton kernels through
    the interpreter) give TP=1's logits."""
    path = str(tmp_path / "wide")
    build_hf_model("moe", seed=11, **WIDE).save_pretrained(path)
    assert_tp_equals_tp1(path, world, kernels, 12, tmp_path)


def test_batched_decode_paths_equal_reference(reference):
    """The decode fast paths (batched DeltaNet step, batched paged attention) against the
    per-sequence reference on the same caches: logits and every cache entry they write."""
    import dataclasses
    _, _, path = reference
    runner = make_runner(path)
    gen = torch.Generator().manual_seed(6)
    lengths, slots = [3, 40, 17], [6, 1, 3]
    tables = [blocks_for(i, n + 1) for i, n in enumerate(lengths)]
    for i, n in enumerate(lengths):
        runner.execute(StepPlan([slots[i]], [torch.randint(0, 1024, (n,), generator=gen).tolist()], [0], [tables[i]],
                                [False]))
    plan = StepPlan(slots, [[11], [12], [13]], lengths, tables, [True] * 3)
    batch = runner.prepare(plan)
    assert batch.is_decode
    with torch.inference_mode():
        fast, fast_caches, slow = from_same_caches(
            runner, lambda: runner.model.compute_logits(runner.model(batch)),
            lambda: runner.model.compute_logits(runner.model(dataclasses.replace(batch, is_decode=False))))
    assert (fast - slow).abs().max().item() <= TOL_SELF
    for a, b in zip(fast_caches, caches(runner)):
        assert (a - b).abs().max().item() <= TOL_SELF


def test_batched_prefill_equals_per_sequence_reference(reference, monkeypatch):
    """DeltaNet's batched mixed step (the decode row through the decode op, the rest through one stacked chunked
    delta rule: mixed_fast) against the sequence-by-sequence reference (mixed_torch), on the same caches."""
    _, _, path = reference
    runner = make_runner(path)
    gen = torch.Generator().manual_seed(8)
    runner.execute(StepPlan([2, 5], [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (20, 9)],
                            [0, 0], [blocks_for(0, 40), blocks_for(1, 10)], [False, False]))
    plan = StepPlan([2, 5, 0, 7], [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (13, 1, 70, 2)],
                    [20, 9, 0, 0], [blocks_for(0, 40), blocks_for(1, 10), blocks_for(2, 70), blocks_for(3, 2)], [True] * 4)

    def run(mixed: str):
        for m in runner.gdn_layers:
            monkeypatch.setattr(m, "_mixed", getattr(m, mixed))
        return runner.execute(plan)

    fast, fast_caches, slow = from_same_caches(runner, lambda: run("mixed_fast"), lambda: run("mixed_torch"))
    assert (fast - slow).abs().max().item() <= TOL_SELF
    for a, b in zip(fast_caches, caches(runner)):
        assert (a - b).abs().max().item() <= TOL_SELF
