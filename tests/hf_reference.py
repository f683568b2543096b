"""Tiny transformers reference models (test-only dependency) and helpers shared by the model tests."""
from __future__ import annotations

import functools
import socket

import torch

TINY_TEXT = dict(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
TINY_MOE = dict(TINY_TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)
TINY_DENSE = dict(TINY_TEXT, intermediate_size=128)


def build_hf_model(kind: str = "moe", seed: int = 0, **overrides):
    """A random fp32 transformers model (the tiny config, with `overrides`); norm weights perturbed so that a
    (1 + w) vs w mix-up cannot pass."""
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)
    torch.manual_seed(seed)
    if kind == "moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**dict(TINY_MOE, **overrides)))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dict(TINY_DENSE, **overrides)))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.5)
    return model


def hf_decode_logits(model, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Logits of the prompt's last token, then of each fed token, through transformers' own cache."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        r = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1])
        for t in steps:
            r = model(torch.tensor([[t]]), past_key_values=r.past_key_values, use_cache=True)
            out.append(r.logits[0, -1])
    return out


def join_ranks(rank: int, world: int, port: int, device: str, hang_s: float | None = None, **env: str) -> None:
    """A spawned rank's start: the launcher's environment (and `env`), then the process group (device "cpu": gloo,
    one torch thread per rank, as the ranks share the machine's cores; "cuda": NCCL and this rank's GPU). With
    hang_s, a rank still running after that many seconds (stuck in a collective) prints every thread's stack and
    exits, so that the test fails instead of hanging."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), **env)
    if device == "cpu":
        import torch
        torch.set_num_threads(1)
    if hang_s is not None:
        import faulthandler
        faulthandler.dump_traceback_later(hang_s, exit=True)
    from dist import parallel
    parallel.init_distributed(device)


def run_ranks(world: int, work, out_file: str, device: str = "cpu", hang_s: float | None = None, **env: str):
    """Rank 0's work() from `world` spawned ranks (join_ranks: gloo on the CPU, NCCL on GPUs). work is a
    module-level function, or a functools.partial of one, so that it reaches the spawned ranks; every rank runs it."""
    torch.multiprocessing.spawn(_rank, args=(world, free_port(), device, work, out_file, hang_s, env), nprocs=world)
    return torch.load(out_file)


def _rank(rank, world, port, device, work, out_file, hang_s, env):
    join_ranks(rank, world, port, device, hang_s, **env)
    from dist import parallel
    try:
        result = work()
        if rank == 0:
            torch.save(result, out_file)
    finally:
        parallel.destroy()


def run_tp(world: int, make_runner, path: str, plans, kernels: str, out_file: str) -> list[torch.Tensor]:
    """The plans' logits at TP=world over gloo: each rank builds its runner with make_runner(path, kernels=kernels)
    (a module-level function, so that it reaches the spawned ranks) and executes every plan."""
    return run_ranks(world, functools.partial(_execute, make_runner, path, plans, kernels), out_file)


def _execute(make_runner, path, plans, kernels):
    runner = make_runner(path, kernels=kernels)
    return [runner.execute(p) for p in plans]


def run_tp_engine(world: int, make, drive, out_file: str, device: str = "cpu", hang_s: float | None = None,
                  **env: str):
    """drive(engine)'s result from an engine at TP=world on spawned ranks: every rank builds make() (module-level
    functions, or functools.partial of them); rank 0 runs drive, then shuts the engine down, which ends the other
    ranks' worker loops."""
    return run_ranks(world, functools.partial(_serve, make, drive), out_file, device, hang_s, **env)


def _serve(make, drive):
    from dist import parallel
    engine = make()
    if parallel.tp_rank() != 0:
        engine.run_worker_loop()
        return None
    result = drive(engine)
    engine.shutdown()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def caches(runner) -> list[torch.Tensor]:
    """Every cache tensor of a ModelRunner: paged K/V, DeltaNet conv tails and recurrent states."""
    return [t for m in runner.model.modules() for t in
            (getattr(m, "k_cache", None), getattr(m, "v_cache", None), getattr(m, "conv_state", None),
             getattr(m, "ssm_state", None)) if t is not None]


def from_same_caches(runner, first, second):
    """Run first() then second() starting from the same cache contents (restored in between).

    Returns (first's result, the caches first left, second's result); the caches are left as second wrote them."""
    before = [t.clone() for t in caches(runner)]
    a = first()
    after_a = [t.clone() for t in caches(runner)]
    for t, b in zip(caches(runner), before):
        t.copy_(b)
    return a, after_a, second()
