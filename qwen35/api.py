"""The logits-level interface that correctness harnesses drive: create_engine(...).prefill/decode/remove.

No batching policy and no sampling: each call is one forward over the listed requests, returning their next-token
logits. Request state (a DeltaNet state slot and paged-KV blocks, taken from the same Scheduler pools the serving
engine allocates from) is held per request id between calls.
"""
from __future__ import annotations

import torch

from dist import parallel
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.scheduler import Scheduler


class LogitsEngine:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # the capacity of the runner's caches; each call's batch is the caller's, so its batching policy is unused
        self.scheduler = Scheduler(runner.num_kv_blocks, runner.block_size, runner.num_state_slots,
                                   runner.max_num_seqs, runner.max_num_seqs)
        self.blocks, self.slots = self.scheduler.blocks, self.scheduler.slots
        self._state: dict = {}  # request id -> {"slot", "blocks", "len"}

    def prefill(self, request_ids: list, input_ids: list[torch.Tensor]) -> torch.Tensor:
        """Start (or restart) each listed request from its prompt; logits [B, vocab] of each prompt's last token."""
        if len(request_ids) != len(input_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("prefill needs one prompt per request and distinct request ids")
        prompts = [torch.as_tensor(t).reshape(-1).tolist() for t in input_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prefill: every prompt needs at least one token")
        self.remove([r for r in request_ids if r in self._state])
        try:
            for rid, prompt in zip(request_ids, prompts):
                self._state[rid] = {"slot": self.slots.allocate()[0], "blocks": [], "len": 0}
                self._grow(rid, len(prompt))
        except Exception:
            self.remove(request_ids)  # all or nothing: no half-admitted request keeps capacity
            raise
        return self._run(request_ids, prompts)

    def decode(self, request_ids: list, token_ids) -> torch.Tensor:
        """Feed one token to each listed (live) request; logits [B, vocab] of the next token."""
        tokens = torch.as_tensor(token_ids).reshape(-1).tolist()
        if len(tokens) != len(request_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("decode needs exactly one token per request and distinct request ids")
        unknown = [r for r in request_ids if r not in self._state]
        if unknown:
            raise KeyError(f"decode: no live request {unknown[0]!r} (prefill it first)")
        for rid in request_ids:
            self._grow(rid, 1)
        return self._run(request_ids, [[t] for t in tokens])

    def remove(self, request_ids: list) -> None:
        for rid in request_ids:
            st = self._state.pop(rid, None)
            if st is not None:
                self.slots.free([st["slot"]])
                self.blocks.free(st["blocks"])

    def _grow(self, rid, n: int) -> None:
        st = self._state[rid]
        if st["len"] + n > self.runner.max_model_len:
            raise ValueError(f"request {rid!r} would reach {st['len'] + n} tokens, past max_model_len "
                             f"{self.runner.max_model_len}")
        need = self.blocks.blocks_for(st["len"] + n) - len(st["blocks"])
        if need > 0:
            st["blocks"] += self.blocks.allocate(need)

    def _run(self, request_ids: list, tokens: list[list[int]]) -> torch.Tensor:
        # every row gives its tokens and its whole block table (the runner keeps the table per slot)
        states = [self._state[r] for r in request_ids]
        plan = StepPlan(state_slots=[s["slot"] for s in states], token_ids=tokens,
                        start_pos=[s["len"] for s in states], block_tables=[list(s["blocks"]) for s in states],
                        want_logits=[True] * len(tokens))
        logits = self.runner.execute(plan, gather="all")
        for s, t in zip(states, tokens):
            s["len"] += len(t)
        return logits


def create_engine(model_config: dict, weight_dir: str | None, device: str | None = None,
                  **engine_kwargs) -> LogitsEngine:
    """A LogitsEngine over the checkpoint in `weight_dir`; sizes come only from `model_config` (a config.json dict).

    The model follows the config's `model_type` (else `architectures`): Qwen3.5 (qwen3_5, qwen3_5_moe) or a dense
    LLaMA-like (llama, qwen2, qwen3). Weights: the directory's safetensors, else its `model.pt` state dict (HF
    names); `load_format="dummy"` with weight_dir None makes random ones. `device` and `engine_kwargs` are
    EngineArgs fields, with its defaults (device: cuda when available; dtype: bf16 on GPU, fp32 on CPU;
    max_model_len: the model's max_position_embeddings up to 32768; max_num_seqs: the requests it can hold at
    once); it has no prefix cache.
    Under torchrun every rank must make the same calls (tensor parallel)."""
    args = EngineArgs(model=weight_dir or "", device=device, prefix_cache=False, **engine_kwargs)
    parallel.init_distributed(args.device_type)
    return LogitsEngine(ModelRunner(ModelConfig.from_dict(model_config), args, weight_dir))
