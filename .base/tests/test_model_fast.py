"""The whole model with the fast kernel set (fused Triton kernels) against transformers on the same random weights.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so CI checks
every fused kernel inside the real model, not only one by one. Same tolerance as the torch path (tests/test_model.py):
max |logit difference| <= 1e-4 in fp32.
"""
import torch

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.hf_reference import hf_decode_logits
from tests.test_model import BLOCK, TOL_HF, blocks_for, reference, worst_decode_error  # noqa: F401 (fixture)


def make_fast_runner(path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = EngineArgs(model=path, device=device, dtype="float32", block_size=BLOCK, max_num_seqs=8, max_model_len=512,
                      kernels="fast", enforce_eager=True)
    return ModelRunner(ModelConfig.from_dir(path), args, path)


def test_fast_kernels_prefill_then_decode_match_transformers(reference):
    _, hf, path = reference
    runner = make_fast_runner(path)
    assert runner.kernels == "fast"
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1024, (67,), generator=gen).tolist()  # crosses a 64-token chunk
    steps = torch.randint(0, 1024, (8,), generator=gen).tolist()
    assert worst_decode_error(runner, hf, prompt, steps) <= TOL_HF


def test_fast_kernels_mixed_step_matches_transformers(reference):
    """A step that mixes a decode row with a prefill chunk: the decode row takes the fast decode kernels."""
    _, hf, path = reference
    runner = make_fast_runner(path)
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(0, 1024, (20,), generator=gen).tolist()
    b = torch.randint(0, 1024, (9,), generator=gen).tolist()
    next_a = 17
    ta, tb = blocks_for(0, 21), blocks_for(1, 9)
    runner.execute(StepPlan([0], [a], [0], [ta], [True]))
    got = runner.execute(StepPlan([0, 1], [[next_a], b], [20, 0], [ta, tb], [True, True])).cpu()
    ref_a = hf_decode_logits(hf, a, [next_a])[-1]
    with torch.no_grad():
        ref_b = hf(torch.tensor([b])).logits[0, -1]
    assert (got[0] - ref_a).abs().max().item() <= TOL_HF
    assert (got[1] - ref_b).abs().max().item() <= TOL_HF
