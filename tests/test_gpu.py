"""GPU-only check of the CUDA-graph decode against eager decode of the same model (pytest -m gpu): 1e-2 max abs on
O(1) logits (padding changes GEMM shapes, hence rounding, nothing else). Each fused kernel is checked against its
torch oracle in tests/test_kernels_<layer>.py (bf16 on the GPU, fp32 through the interpreter on the CPU).
"""
import pytest
import torch

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
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
    runners = [ModelRunner(cfg, EngineArgs(model=tiny_dir, device="cuda", dtype="bfloat16", max_num_seqs=40,
                                           max_model_len=256, enforce_eager=eager), tiny_dir)
               for eager in (True, False)]
    assert runners[0].graphs is None and runners[1].graphs is not None
    gen = torch.Generator().manual_seed(0)
    assert 33 not in runners[1].graphs.graphs and 36 in runners[1].graphs.graphs
    for n in (1, 3, 33):  # 33 runs the graph of 36 with three padded rows
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


def test_warm_up_leaves_no_kernel_to_compile(tiny_dir, tmp_path):
    """After ModelRunner.warm_up, random prefill and mixed steps (0-15 decode rows, then 1-3 chunks, fresh or
    resumed, any token count up to the budget, checkpoints) compile no Triton kernel: no request pays a compile
    (~1 s) in the middle of serving. Counted as new entries of a fresh TRITON_CACHE_DIR, in a subprocess (Triton
    reads the variable at import)."""
    import os
    import subprocess
    import sys
    import textwrap
    cache = str(tmp_path / "triton")
    script = textwrap.dedent(f"""
        import glob, random, torch
        from layers.deltanet_prefill import CHUNK
        from qwen35.config import ModelConfig
        from qwen35.engine_config import EngineArgs
        from qwen35.runner import ModelRunner
        budget = 512
        args = EngineArgs(model={tiny_dir!r}, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=1024)
        r = ModelRunner(ModelConfig.from_dir({tiny_dir!r}), args, {tiny_dir!r}, num_snapshot_slots=2)
        print("warm-up steps", r.warm_up(budget))
        from layers.backend import on_compile
        on_compile(lambda kernel: print("KERNEL", kernel[:600]))
        entries = lambda: len(glob.glob({cache!r} + "/*"))
        before, rng = entries(), random.Random(0)
        for i in range(60):
            d = rng.randrange(0, 16)
            chunks = rng.randrange(1, min(3, 16 - d) + 1)
            n = rng.randrange(2 * chunks, budget - d + 1)
            sizes = [n // chunks] * (chunks - 1) + [n - (chunks - 1) * (n // chunks)]
            rows = [(CHUNK, 0)] * d + [(rng.choice([0, CHUNK]), k) for k in sizes]
            p = r.rows_plan(rows, lambda k: torch.randint(0, 1000, (k,)).tolist(), checkpoint=rng.random() < 0.3)
            r.execute(p, gather="none")
            torch.cuda.synchronize()
            if entries() != before:
                print("COMPILED at step", i, "rows", rows[:1], len(rows), "tokens", p.num_tokens)
                before = entries()
        print("done")
    """)
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    assert "COMPILED" not in out.stdout, out.stdout
