"""The start-up warm-ups meet every Triton kernel variant that serving can meet (issue #9: a compile costs ~1 s in
the middle of serving; 2026-11-25, 1x H200: 13 compiles in a cold trace level after the first warm-up). Checked on
the CPU by the compile keys of the interpreted launches (tests/triton_keys.py); tests/test_gpu.py counts real
compiles on a GPU."""
from __future__ import annotations

import random

import pytest
import torch

from layers.deltanet_prefill import CHUNK
from layers.sampler import Sampler, SamplingStep
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from tests.triton_keys import launch_key, record, unmet

pytest.importorskip("triton")

SEQS, BUDGET = 64, 1024


def random_rows(rng: random.Random) -> list[tuple[int, int]]:
    """A step of d decode rows (fed from the device) and 1-40 prefill chunks, fresh or resumed, of any sizes."""
    d = rng.randrange(0, SEQS)
    chunks = rng.randrange(1, min(40, SEQS - d) + 1)
    n = rng.randrange(2 * chunks, BUDGET - d + 1)
    cuts = sorted(rng.sample(range(1, n), chunks - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    return [(CHUNK, 0)] * d + [(rng.choice([0, CHUNK]), k) for k in sizes]


def warmed_up(path: str, **kw) -> tuple[ModelRunner, dict]:
    args = EngineArgs(model=path, device="cpu", dtype="bfloat16", kernels="fast", max_num_seqs=SEQS,
                      max_model_len=BUDGET)
    runner = ModelRunner(ModelConfig.from_dir(path), args, path, **kw)
    with record() as met:
        runner.warm_up(BUDGET)
    return runner, met


def unmet_in_random_steps(runner: ModelRunner, met: dict, checkpoints: bool) -> list[str]:
    rng, seen = random.Random(0), []
    for i in range(80):
        rows = random_rows(rng)
        plan = runner.rows_plan(rows, lambda k: torch.randint(0, 1000, (k,)).tolist(),
                                checkpoint=checkpoints and rng.random() < 0.3)
        if plan is None:
            continue
        with record() as keys:
            runner.execute(plan, gather="none")
        seen += [f"step {i} ({len(rows)} rows, {plan.num_tokens} tokens) {u}" for u in unmet(keys, met)]
    return seen


def test_warm_up_meets_the_kernel_variants_of_random_steps(tiny_dir):
    runner, met = warmed_up(tiny_dir, num_snapshot_slots=4)
    assert {"_prefill_kernel", "_state_kernel", "_gate_up_kernel"} <= set(met), sorted(met)
    seen = unmet_in_random_steps(runner, met, checkpoints=True)
    assert not seen, "\n".join(seen[:20])


def test_dense_warm_up_meets_the_kernel_variants_of_random_steps(cache_dir):
    """The tiny Llama: its warm-up meets the dense MLP's gated GEMMs (the GEMV at 1 and 2 rows, the rows kernel's
    16-row tile), and random steps meet nothing it did not."""
    from qwen35.hub import resolve_model
    runner, met = warmed_up(resolve_model("tiny-llama"))
    gated = [k for name in ("_gemv_kernel", "_rows_kernel") for k in met[name] if "GATED=True" in k]
    assert {p for k in gated for p in k if p.startswith("BLOCK_M=")} == {"BLOCK_M=1", "BLOCK_M=2", "BLOCK_M=16"}
    seen = unmet_in_random_steps(runner, met, checkpoints=False)
    assert not seen, "\n".join(seen[:20])


def test_sampler_warm_up_meets_every_kind_of_step(tiny_dir):
    """Sampler.warm_up runs the shard pass's variants (greedy, sampled, filtered) and leaves the slots' draw
    counters as they were; steps of any batch size and kind then meet no new key."""
    sampler = Sampler(1000, ModelConfig.from_dir(tiny_dir).vocab_size, 8, "cpu")
    sampler.draws.copy_(torch.arange(8))
    with record() as met:
        sampler.warm_up()
    assert torch.equal(sampler.draws, torch.arange(8))
    assert len(met["_shard_pass_kernel"]) == 3
    rng = random.Random(0)
    for _ in range(12):
        B = rng.randrange(1, 9)
        flags = rng.choice([(True, False, False), (False, False, False), (False, True, False), (False, False, True),
                            (False, True, True)])
        with record() as keys:
            sampler.sample(torch.randn(B, sampler.vocab_size), torch.randperm(8)[:B], SamplingStep(*flags))
        assert not unmet(keys, met), (B, flags, unmet(keys, met))


def test_launch_key_follows_tritons_specialisation_rules():
    """The recorder's rules: 1 and multiples of 16 are specialised, other integers are not, a pointer by its
    16-byte alignment; do_not_specialize turns both off."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["m"])
    def k(x_ptr, n, m, BLOCK: tl.constexpr):
        pass

    x = torch.zeros(64)
    keys = [launch_key(k, (t, n, n), {"BLOCK": 4, "num_warps": 4}) for t, n in ((x, 1), (x, 32), (x, 7), (x[1:], 7))]
    assert keys[0] == ("x_ptr:*torch.float32D", "n:=1", "m:i", "BLOCK=4", "num_warps=4")
    assert keys[1][1:3] == ("n:iD", "m:i") and keys[2][1:3] == ("n:i", "m:i")
    assert keys[3][0] == "x_ptr:*torch.float32"
