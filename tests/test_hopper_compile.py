"""Every Triton kernel variant a decode and a prefill step of the tiny MoE model and of the tiny Llama launch (fast
kernels, bf16, through the interpreter on the CPU) compiles for a Hopper GPU (sm_90) through Triton's compiler and
ptxas: code the interpreter accepts but the compiler refuses fails here, not on the device (tests/hopper_compile.py).
The Llama's steps run its dense MLP's gate_up with silu(gate) * up in the epilogue of the GEMV (1 and 2 rows, the
norm folded in at one) and of the rows kernel (a 3-token step)."""
import pytest
import torch

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import PRESETS
from scheduler.plan import StepPlan
from tests.hopper_compile import compile_all, hopper_backend_available, recorded

TABLES = [[1, 2, 3, 4], [5, 6, 7, 8]]

MOE_KERNELS = {"_gemv_kernel", "_decode_kernel", "_gate_up_persistent_kernel", "_down_combine_kernel",
               "_set_tables_kernel"}
DENSE_KERNELS = {"_gemv_kernel", "_rows_kernel", "_silu_mul_kernel", "_decode_split_kernel", "_set_tables_kernel"}
TINY_LLAMA = {**PRESETS["tiny-llama"], "vocab_size": 1024}  # (a small vocabulary: the interpreter runs the LM head)


@pytest.fixture(autouse=True)
def gpu_tiling(monkeypatch):
    """The GEMMs tiled as on a GPU (no wider programs for the interpreter: linear._cpu_columns), so that the
    variants compiled here are the ones a GPU launches."""
    from layers import linear
    monkeypatch.setattr(linear, "CPU_MAX_PROGRAMS", 1 << 40)


def steps(three_tokens: bool) -> list[StepPlan]:
    """Two prompts, a 1-row and a 2-row decode step, and with three_tokens a 3-token step (the rows kernel's)."""
    plans = [StepPlan([0, 1], [list(range(1, 21)), list(range(3, 12))], [0, 0], TABLES, [True, True]),
             StepPlan([0], [[5]], [20], [TABLES[0]], [True]),
             StepPlan([0, 1], [[7], [8]], [21, 9], TABLES, [True, True])]
    return plans + [StepPlan([0], [[9, 10, 11]], [22], [TABLES[0]], [True])] if three_tokens else plans


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("config,three_tokens,kernels,gated_rows", [
    (PRESETS["tiny"], False, MOE_KERNELS, set()),
    (TINY_LLAMA, True, DENSE_KERNELS, {1, 2, 16}),
], ids=["tiny", "tiny-llama"])
def test_decode_and_prefill_kernels_compile_for_hopper(config, three_tokens, kernels, gated_rows):
    """gated_rows: the row tiles (BLOCK_M) of the gated GEMM launches (the GEMV's 1 and 2, the rows kernel's 16),
    one of them with the norm folded in."""
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    runner = ModelRunner(ModelConfig.from_dict(config),
                         EngineArgs(model="tiny", load_format="dummy", device="cpu", dtype="bfloat16", kernels="fast",
                                    max_num_seqs=4, max_model_len=128))
    with recorded() as launches:
        for plan in steps(three_tokens):
            runner.execute(plan)
    names = {e["name"] for e in launches}
    assert kernels <= names, names
    gated = [e["constexprs"] for e in launches if e["constexprs"].get("GATED")]
    assert {e["BLOCK_M"] for e in gated} == gated_rows and any(e.get("NORM") for e in gated) == bool(gated_rows), gated
    assert compile_all(launches) == []


@pytest.mark.timeout(1500)
def test_verify_step_kernels_compile_for_hopper():
    """The same for speculative decoding: a prefill that proposes, then greedy and sampled verify steps (the verify
    rows, the DeltaNet verify and commit, the sampling passes over vocabulary shards, the MTP head's drafts)."""
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    from layers.sampler import Sampler, SamplingStep
    from tests.test_mtp import small_vocab
    vocab, k = 512, 2
    runner = ModelRunner(ModelConfig.from_dict(small_vocab(vocab)),
                         EngineArgs(model="", load_format="dummy-spec", device="cpu", dtype="bfloat16",
                                    kernels="fast", max_num_seqs=4, max_model_len=128, mtp=True,
                                    speculative_tokens=k, seed=1))
    runner.attach_sampler(Sampler(vocab - 64, vocab, runner.scratch_slot + 1, "cpu"), host_ring=False)
    runner.sampler.admit(SamplingStep(admitted=[(0, (0.0, 0, 1.0), 1), (1, (1.0, 0, 1.0), 2)]))
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    sampled = SamplingStep(greedy_only=False)
    with recorded() as launches:
        runner.sample_step(StepPlan([0, 1], [list(range(1, 21)), list(range(3, 12))], [0, 0], tables, [True, True],
                                    draft_k=k), sampled)
        starts = [20, 9]
        for step, rows in ((sampled, [0, 1]), (SamplingStep(greedy_only=True), [0])):
            out = runner.sample_step(StepPlan(rows, [[] for _ in rows], [starts[r] for r in rows],
                                              [[] for _ in rows], [True] * len(rows), spec_k=k, draft_k=k), step)
            for r, row in zip(rows, out.tolist()):
                starts[r] += sum(t >= 0 for t in row)
    names = {e["name"] for e in launches}
    assert {"_verify_rows_kernel", "_stats_kernel", "_verify_kernel", "_commit_kernel"} <= names, names
    assert compile_all(launches) == []
