"""GPU-only check of the CUDA-graph decode against eager decode of the same model (pytest -m gpu): 1e-2 max abs on
O(1) logits (padding changes GEMM shapes, hence rounding, nothing else). Each fused kernel is checked against its
torch oracle in tests/test_kernels_<layer>.py (bf16 on the GPU, fp32 through the interpreter on the CPU).
"""
import pytest
import torch

from qwen35.config import ModelConfig
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.hf_reference import build_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpu-tiny"))
    build_hf_model("moe", seed=11).save_pretrained(path)
    return path


def test_cuda_graph_decode_equals_eager(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)
    runners = [ModelRunner(cfg, model_dir=tiny_dir, device="cuda", dtype="bfloat16", max_num_seqs=8,
                           max_model_len=256, enforce_eager=eager) for eager in (True, False)]
    assert runners[0].graphs is None and runners[1].graphs is not None
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 8):  # 3 runs the graph of 4 with a padded row
        prompts = [torch.randint(0, 1024, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]
        tables = [list(range(16 * i, 16 * i + 16)) for i in range(n)]
        fed = torch.randint(0, 1024, (20, n), generator=gen).tolist()  # the same tokens through both runners
        outs = []
        for r in runners:
            r.execute(StepPlan(list(range(n)), prompts, [0] * n, tables, [True] * n))
            pos, steps = [len(p) for p in prompts], []
            for toks in fed:
                steps.append(r.execute(StepPlan(list(range(n)), [[t] for t in toks], pos, tables, [True] * n)))
                pos = [p + 1 for p in pos]
            outs.append(torch.stack(steps))
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-2
