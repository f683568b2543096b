"""The users' tensor-parallel degree, 8 ranks, on the CPU over gloo (no 8-GPU machine has run it yet).

A tiny checkpoint with the release's head ratios (16 query heads over 2 KV heads: each KV head replicated on 4 ranks;
16 DeltaNet key heads over 32 value heads: 2 and 4 a rank; every expert's and the shared expert's rows split 8 ways,
8 a rank; the vocabulary in 8 shards) runs the engine on 8 processes. Greedy tokens equal transformers' `generate` on
the same weights, and a seeded sampled request equals the engine's at TP=1. With the torch kernels: the fast ones
take the same shards (the sharding is the model's, not the kernels'), and through the interpreter this engine run
took 678 s at TP=1 alone (its 248K-column LM head and sampler each step); their collectives are tested at 8 simulated
peers (tests/test_allreduce.py, tests/test_push.py) and their kernels at TP=8 rank shapes on the GPU.
"""
import json
from functools import partial

import pytest
import torch

from qwen35 import synth
from qwen35.engine import EngineArgs, LLMEngine
from qwen35.sampling_params import SamplingParams
from tests.test_engine import run

from hf_reference import run_tp_engine

TP = 8
N_NEW = 12
PROMPTS = [[(7919 * i + 13 * j) % 248_000 for j in range(n)] for i, n in enumerate((5, 40, 17))]
GREEDY = SamplingParams(max_tokens=N_NEW, min_tokens=N_NEW)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=N_NEW, min_tokens=N_NEW, seed=11)


def release_ratios() -> dict:
    """The tiny preset with the release's head counts (spec section 1) at tiny widths."""
    raw = json.loads(json.dumps(synth.PRESETS["tiny"]))
    raw["text_config"].update(num_attention_heads=16, num_key_value_heads=2, head_dim=16, linear_num_key_heads=16,
                              linear_num_value_heads=32, linear_key_head_dim=8, linear_value_head_dim=8,
                              moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return raw


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth.write_checkpoint(str(tmp_path_factory.mktemp("tp8")), release_ratios(), seed=3)


@pytest.fixture(scope="module")
def hf_tokens(ckpt):
    from transformers import Qwen3_5MoeForCausalLM
    model = Qwen3_5MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                               do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def make_engine(path: str, kernels: str, tp: int = 1, k: int = 0, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, tp=tp, kernels=kernels, max_num_seqs=4, max_model_len=128,
                                max_num_batched_tokens=64, dtype="float32", device="cpu", speculative_tokens=k,
                                **kw))


def generate(engine: LLMEngine, greedy: SamplingParams = GREEDY, seeded: SamplingParams = SEEDED) -> dict:
    """Every prompt greedy and the first one seeded, added together; {rid: token ids}."""
    done, _ = run(engine, [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)] + [("seeded", PROMPTS[0], seeded)])
    return {rid: out[0] for rid, out in done.items()}


def generated_and_accepted(engine: LLMEngine, params=()) -> dict:
    got = generate(engine, *params)
    got["accepted"] = engine.stats()["spec_accepted_tokens"]
    return got


def run_tp8(ckpt: str, out, k: int = 0, params=(), **kw) -> dict:
    return run_tp_engine(TP, partial(make_engine, ckpt, "torch", tp=TP, k=k, **kw),
                         partial(generated_and_accepted, params=params), str(out), hang_s=600)


def test_tp8_gives_transformers_greedy_tokens_and_tp1_sampled_ones(ckpt, hf_tokens, tmp_path):
    got = run_tp8(ckpt, tmp_path / "tp8.pt")
    for i, want in enumerate(hf_tokens):
        assert got[f"g{i}"] == want, f"prompt {i}"
    tp1 = generate(make_engine(ckpt, "torch"))
    assert got["seeded"] == tp1["seeded"] and len(got["seeded"]) == N_NEW


def test_tp8_speculation_gives_the_tokens_of_no_speculation(ckpt, tmp_path):
    """The MTP head at TP=8 (its attention's KV head replicated, its MoE split 8 ways) drafting 2 tokens a step on
    the synthetic-acceptance weights (drafts accepted, so verify steps of 3 rows a request and rollbacks both run):
    greedy tokens equal those without speculation (TP=1), and the seeded request equals TP=1's with speculation.
    (EOS ignored rather than suppressed: no drafts are proposed while a request's stop ids are suppressed.)"""
    params = (SamplingParams(max_tokens=N_NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=N_NEW, seed=11, ignore_eos=True))
    got = run_tp8(ckpt, tmp_path / "tp8_spec.pt", k=2, params=params, load_format="dummy-spec")
    assert got["accepted"] > 0
    off = generate(make_engine(ckpt, "torch", k=0, load_format="dummy-spec"), *params)
    for i in range(len(PROMPTS)):
        assert got[f"g{i}"] == off[f"g{i}"] and len(off[f"g{i}"]) == N_NEW, f"prompt {i}"
    on = generate(make_engine(ckpt, "torch", k=2, load_format="dummy-spec"), *params)
    assert got["seeded"] == on["seeded"]
