"""Every Triton kernel variant a decode and a prefill step of the tiny MoE model launch (fast kernels, bf16, through
the interpreter on the CPU) compiles for a Hopper GPU (sm_90) through Triton's compiler and ptxas: code the
interpreter accepts but the compiler refuses fails here, not on the device (tests/hopper_compile.py)."""
import pytest
import torch

from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from qwen35.synth import PRESETS
from scheduler.plan import StepPlan
from tests.hopper_compile import compile_all, hopper_backend_available, recorded


@pytest.mark.timeout(1500)
def test_decode_and_prefill_kernels_compile_for_hopper():
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    runner = ModelRunner(ModelConfig.from_dict(PRESETS["tiny"]),
                         EngineArgs(model="tiny", load_format="dummy", device="cpu", dtype="bfloat16", kernels="fast",
                                    max_num_seqs=4, max_model_len=128))
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    with recorded() as launches:
        runner.execute(StepPlan([0, 1], [list(range(1, 21)), list(range(3, 12))], [0, 0], tables, [True, True]))
        runner.execute(StepPlan([0], [[5]], [20], [tables[0]], [True]))
        runner.execute(StepPlan([0, 1], [[7], [8]], [21, 9], tables, [True, True]))
    names = {e["name"] for e in launches}
    assert {"_gemv_kernel", "_decode_kernel", "_gate_up_persistent_kernel", "_down_combine_kernel",
            "_set_tables_kernel"} <= names, names
    assert compile_all(launches) == []
