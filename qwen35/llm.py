"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`.

One process runs TP=1. Under torchrun every rank constructs the LLM; ranks other than 0 then serve rank 0's steps
inside the constructor and leave the script with SystemExit(0) once rank 0 shuts the engine down (at the latest
when its interpreter exits), so the same script works unchanged for any TP size.
"""
from __future__ import annotations

import atexit
from typing import Mapping, Sequence

from dist import parallel
from qwen35.engine import LLMEngine
from qwen35.engine_config import EngineArgs
from qwen35.outputs import CompletionOutput, Usage
from qwen35.spec_costs import measure_at_start
from scheduler.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_kwargs):
        """`model`: a directory, a Hugging Face id or a preset; `engine_kwargs`: EngineArgs fields (tp, dtype, device,
        max_num_seqs, ...), with its defaults."""
        args = EngineArgs(model=model, **engine_kwargs)
        parallel.init_distributed(args.device_type)
        self.engine = LLMEngine(args)
        if not parallel.is_driver():
            self.engine.run_worker_loop()
            raise SystemExit(0)
        measure_at_start(self.engine)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0
        atexit.register(self.engine.shutdown)  # releases the worker ranks if the script never calls shutdown()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _prompt_ids(self, prompts) -> list[list[int]]:
        """str | chat (list of messages) | a list of either -> one token list per prompt."""
        def one(p) -> list[int]:
            if isinstance(p, str):
                return self.tokenizer.encode(p)
            if isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
                return self.tokenizer.encode_chat(p, add_generation_prompt=True, enable_thinking=False)
            raise ValueError(f"a prompt must be a string or a list of chat messages, got {type(p).__name__}")

        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], Mapping)):
            return [one(prompts)]
        return [one(p) for p in prompts]

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Run the prompts to completion (batched by the scheduler); results in prompt order."""
        all_ids = self._prompt_ids(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(all_ids)
        if len(params) != len(all_ids):
            raise ValueError(f"{len(params)} sampling params for {len(all_ids)} prompts")
        for ids, sp in zip(all_ids, params):  # the boundary: all or nothing, rejected before any is queued
            self.engine.check_request(ids, sp)
        results: dict[str, CompletionOutput] = {}
        for ids, sp in zip(all_ids, params):
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, sp, stream=False)  # one output each, at its end
            results[rid] = CompletionOutput(rid, "", usage=Usage(len(ids), 0))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                r = results[out.request_id]
                r.text += out.text
                r.token_ids += out.token_ids
                r.usage.completion_tokens = out.num_completion_tokens
                r.finish_reason, r.error = out.finish_reason, out.error
        return list(results.values())
