"""The runner's speculative steps (qwen35/runner.py verify_step, draft buffers, plan.spec_k / plan.draft_k) on the
tiny model with a small vocabulary, fp32, CPU, torch kernels.

- greedy: the tokens of verify steps (k = 1, 2, 3) == plain decoding's, token for token, with the
  synthetic-acceptance weights (`dummy-spec`: greedy drafts are always accepted, so every step emits k + 1) and with
  random weights (`dummy`: drafts are almost always rejected, so every step rolls back); rows of different lengths
  in slots out of order.
"""
import pytest
import torch

from layers.sampler import Sampler, SamplingStep
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.test_mtp import small_vocab

VOCAB = 512
BLOCK = 16
SLOTS = [2, 0, 3]


def make_runner(load_format: str, k, acceptance: float = 0.7, seqs: int = 4) -> ModelRunner:
    cfg = ModelConfig.from_dict(small_vocab(VOCAB))
    args = EngineArgs(model="", load_format=load_format, spec_acceptance=acceptance, device="cpu", dtype="float32",
                      kernels="torch", block_size=BLOCK, max_num_seqs=seqs, max_model_len=256, mtp=True,
                      speculative_tokens=k, seed=1)
    runner = ModelRunner(cfg, args)
    runner.attach_sampler(Sampler(VOCAB - 64, VOCAB, runner.scratch_slot + 1, "cpu"), host_ring=False)
    return runner


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 64, (L,), generator=gen).tolist() for L in (7, 19, 3)][:n]


def admit(runner, settings, keys=None):
    """The rows' sampling settings (temperature, top_k, top_p) into their slots, as the engine's admission does."""
    keys = keys or [100 + s for s in SLOTS]
    runner.sampler.admit(SamplingStep(admitted=[(s, tuple(p), key) for s, p, key in zip(SLOTS, settings, keys)]))


def prefill_plan(ps, draft_k):
    width = 256 // BLOCK
    return StepPlan([*SLOTS[:len(ps)]], [list(p) for p in ps], [0] * len(ps),
                    [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(len(ps))], [True] * len(ps),
                    draft_k=draft_k)


def decode_plan(starts, spec_k=0, draft_k=0):
    n = len(starts)
    return StepPlan([*SLOTS[:n]], [[] for _ in range(n)], list(starts), [[] for _ in range(n)], [True] * n,
                    spec_k=spec_k, draft_k=draft_k)


def plain_tokens(runner, ps, steps, step=SamplingStep()):
    out = [[t] for t in runner.sample_step(prefill_plan(ps, 0), step).tolist()]
    starts = [len(p) for p in ps]
    for _ in range(steps - 1):
        for o, t in zip(out, runner.sample_step(decode_plan(starts), step).tolist()):
            o.append(t)
        starts = [s + 1 for s in starts]
    return out


def spec_tokens(runner, ps, steps, k, step=SamplingStep()):
    """Verify steps of k drafts until every row has `steps` tokens; also the tokens emitted per step."""
    out = [[t] for t in runner.sample_step(prefill_plan(ps, k), step).tolist()]
    starts = [len(p) for p in ps]
    per_step = []
    while min(map(len, out)) < steps:
        emitted = runner.sample_step(decode_plan(starts, k, k), step).tolist()
        per_step.append([sum(t >= 0 for t in row) for row in emitted])
        for i, row in enumerate(emitted):
            run = [t for t in row if t >= 0]
            out[i] += run
            starts[i] += len(run)
    return [o[:steps] for o in out], per_step


@pytest.mark.parametrize("load_format", ["dummy-spec", "dummy"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_verify_steps_give_plain_decoding_tokens(load_format, k):
    ps, steps = prompts(3), 12
    plain = make_runner(load_format, 0)
    admit(plain, [(0, 0, 1)] * 3)
    expected = plain_tokens(plain, ps, steps)
    spec = make_runner(load_format, k)
    admit(spec, [(0, 0, 1)] * 3)
    got, per_step = spec_tokens(spec, ps, steps, k)
    assert got == expected
    emitted = [n for row in per_step for n in row]
    if load_format == "dummy-spec":
        assert min(emitted) == k + 1  # greedy drafts of the synthetic weights are always right
    else:
        assert sum(emitted) / len(emitted) < 1.5  # random weights: nearly every draft rejected
