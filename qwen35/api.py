"""The logits-level interface that correctness harnesses drive: create_engine(...).prefill/decode/remove.

No batching policy and no sampling: each call is one forward over the listed requests, returning their next-token
logits. Request state (a DeltaNet state slot and paged-KV blocks, taken from the same Scheduler pools the serving
engine allocates from) is held per request id between calls.

Warm from the first call: create_engine compiles every kernel and replays every CUDA graph a call can meet before
it returns (LogitsEngine.warm_up), so that no timed call pays a compile (~1 s each) or a graph's first upload.
"""
from __future__ import annotations

import logging
import time

import torch

from dist import parallel
from qwen35.config import ModelConfig
from qwen35.cuda_graphs import capture_sizes
from qwen35.engine_config import EngineArgs
from qwen35.prefill_graphs import PrefillGraphs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from scheduler.scheduler import Scheduler

log = logging.getLogger("qwen35.api")


class LogitsEngine:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # the capacity of the runner's caches; each call's batch is the caller's, so its batching policy is unused
        self.scheduler = Scheduler(runner.num_kv_blocks, runner.block_size, runner.num_state_slots,
                                   runner.max_num_seqs, runner.max_num_seqs)
        self.blocks, self.slots = self.scheduler.blocks, self.scheduler.slots
        self._state: dict = {}  # request id -> {"slot", "blocks", "len", "sent": blocks the runner holds}
        self.creation_s: float | None = None  # create_engine: seconds it took

    def prefill(self, request_ids: list, input_ids: list[torch.Tensor]) -> torch.Tensor:
        """Start (or restart) each listed request from its prompt; logits [B, vocab] of each prompt's last token."""
        if len(request_ids) != len(input_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("prefill needs one prompt per request and distinct request ids")
        prompts = [torch.as_tensor(t).reshape(-1) for t in input_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prefill: every prompt needs at least one token")
        for rid, p in zip(request_ids, prompts):
            self._check_ids(f"prefill of request {rid!r}", p)
        prompts = [p.tolist() for p in prompts]
        self.remove([r for r in request_ids if r in self._state])
        try:
            for rid, prompt in zip(request_ids, prompts):
                self._state[rid] = {"slot": self.slots.allocate()[0], "blocks": [], "len": 0}
                self._grow(rid, len(prompt))
                self._reserve_next(rid, len(prompt))
        except Exception:
            self.remove(request_ids)  # all or nothing: no half-admitted request keeps capacity
            raise
        return self._run([self._state[r] for r in request_ids], prompts)

    def decode(self, request_ids: list, token_ids) -> torch.Tensor:
        """Feed one token to each listed (live) request; logits [B, vocab] of the next token. Tokens given on a GPU
        are used as they are (reading them back to check them would wait for the device)."""
        tokens = torch.as_tensor(token_ids).reshape(-1)
        if tokens.numel() != len(request_ids) or len(set(request_ids)) != len(request_ids):
            raise ValueError("decode needs exactly one token per request and distinct request ids")
        states = list(map(self._state.get, request_ids))
        if None in states:
            raise KeyError(f"decode: no live request {request_ids[states.index(None)]!r} (prefill it first)")
        if tokens.device.type != "cuda":  # (tokens on a GPU, e.g. the last call's argmax: not read back, no sync)
            self._check_ids("decode", tokens)
        bs, longest = self.runner.block_size, self.runner.max_model_len
        for rid, st in zip(request_ids, states):
            if st["len"] % bs == 0 or st["len"] >= longest:  # (else the token fits the request's last block)
                self._grow(rid, 1)
        return self._run(states, tokens)

    def _check_ids(self, what: str, ids: torch.Tensor) -> None:
        """A clear error for token ids that are not integers in [0, vocab_size): on a GPU one would index past the
        embedding inside a kernel, and the device error would end the process."""
        vocab = self.runner.config.vocab_size
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"{what}: token ids must be integers, got {ids.dtype}")
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][0].item()
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")

    def remove(self, request_ids: list) -> None:
        for rid in request_ids:
            st = self._state.pop(rid, None)
            if st is not None:
                self.slots.free([st["slot"]])
                self.blocks.free(st["blocks"])

    def _reserve_next(self, rid, n: int) -> None:
        """A prompt of n tokens that fills its last block gets the block its first decode token goes to now, where
        a free one exists: the prefill sends the table with it, so the first decode call sends none (it had sent
        every row's table again: ~0.5 ms of host at 64 rows)."""
        if n % self.runner.block_size == 0 and n < self.runner.max_model_len and self.blocks.num_free:
            self._state[rid]["blocks"] += self.blocks.allocate(1)

    def _grow(self, rid, n: int) -> None:
        st = self._state[rid]
        if st["len"] + n > self.runner.max_model_len:
            raise ValueError(f"request {rid!r} would reach {st['len'] + n} tokens, past max_model_len "
                             f"{self.runner.max_model_len}")
        need = self.blocks.blocks_for(st["len"] + n) - len(st["blocks"])
        if need > 0:
            st["blocks"] += self.blocks.allocate(need)

    @torch.inference_mode()
    def _run(self, states: list[dict], tokens: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """One forward: prompts (lists) or one token per row (a tensor). Tokens elsewhere than the runner's device
        travel in the plan (the one copy of the step's rows); a tensor on its device is written there into the
        rows' slots (runner.slot_tokens, which a row without tokens feeds), so that a call fed the argmax of the
        last one's logits costs no host sync and the host can queue it while the device still runs the last. A row
        sends its block table only when the table grew since the runner got it (the runner keeps each slot's
        table)."""
        slots = [s["slot"] for s in states]
        if isinstance(tokens, list):
            lens = [len(t) for t in tokens]
        elif tokens.device == self.runner.device:
            self._feed(slots, tokens)
            tokens, lens = [[]] * len(slots), [1] * len(slots)
        else:
            tokens, lens = [[t] for t in tokens.tolist()], [1] * len(slots)
        tables = [list(s["blocks"]) if len(s["blocks"]) != s.get("sent") else [] for s in states]
        plan = StepPlan(state_slots=slots, token_ids=tokens, start_pos=[s["len"] for s in states],
                        block_tables=tables, want_logits=[True] * len(slots))
        logits = self.runner.execute(plan, gather="all")
        for s, n in zip(states, lens):
            s["len"] += n
            s["sent"] = len(s["blocks"])
        return logits

    def _feed(self, slots: list[int], tokens: torch.Tensor) -> None:
        """tokens (on the runner's device) become the tokens `slots` feed next: the slots' one copy from the host
        and a scatter, no sync."""
        slots_d = torch.tensor(slots, dtype=torch.int64, pin_memory=self.runner._pin)
        self.runner.slot_tokens.index_copy_(0, slots_d.to(tokens.device, non_blocking=True), tokens.long())

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> dict:
        """Meet before any call what a call can meet: the prefill and mixed kernel variants up to `max_tokens`
        tokens a step (runner.warm_up_plans), a decode call of every graph size (its first replay: a graph's
        first launch uploads it; without graphs, an eager decode step of that size), the LM head over every
        row count up to max_num_seqs (its GEMV / GEMM variants go by rows) and the feed of a decode call's device
        tokens at each row count; then, for a dense model at TP=1, the prefill graphs (qwen35/prefill_graphs.py).
        Request state is not touched: the decode rows are the scratch slot's (graphs) or slots that every later
        prefill resets, and no request is live yet. Returns what ran."""
        if self._state:
            raise RuntimeError("warm_up runs before any request (it writes slots and blocks from 0)")
        runner, t0 = self.runner, time.perf_counter()
        steps = runner.warm_up(max_tokens)
        sizes = capture_sizes(runner.max_num_seqs)
        for b in sizes:
            if runner.graphs is not None:
                runner.graphs.run([runner.scratch_slot] * b, [0] * b, None)
            else:
                plan = runner.rows_plan([(1, 0)] * b, list)
                if plan is not None:
                    runner.execute(plan, gather="all")
        hidden = torch.zeros(runner.max_num_seqs, runner.config.hidden_size, dtype=runner.dtype,
                             device=runner.device)
        scratch = torch.zeros(runner.max_num_seqs, dtype=torch.int64, device=runner.device)
        for n in range(1, runner.max_num_seqs + 1):
            runner.model.compute_logits(hidden[:n], gather="all")
            self._feed([runner.scratch_slot] * n, scratch[:n])  # (its pinned buffer of each size, first used here)
        if runner.graphs is not None and not runner.gdn_layers and parallel.tp_size() == 1:
            runner.prefill_graphs = PrefillGraphs(runner, max_tokens, pool=runner.graphs.pool)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        done = {"steps": steps, "decode_sizes": len(sizes), "logits_shapes": runner.max_num_seqs,
                "prefill_graphs": len(runner.prefill_graphs.graphs) if runner.prefill_graphs else 0,
                "seconds": time.perf_counter() - t0}
        if parallel.is_driver():
            log.info("warm-up: %d prefill / mixed steps (up to %d tokens), decode calls of %d sizes, the LM head over "
                     "1..%d rows, %d prefill graphs in %.1f s", steps, max_tokens, len(sizes), runner.max_num_seqs,
                     done["prefill_graphs"], done["seconds"])
        return done


def needs_warm_up(runner: ModelRunner) -> bool:
    """On a GPU the first call of a shape pays compiles (Triton), a graph's upload and library set-up; on the CPU
    nothing is compiled (Triton's interpreter or torch), so nothing is gained."""
    return runner.device.type == "cuda"


def create_engine(model_config: dict, weight_dir: str | None, device: str | None = None,
                  **engine_kwargs) -> LogitsEngine:
    """A LogitsEngine over the checkpoint in `weight_dir`; sizes come only from `model_config` (a config.json dict).

    The model follows the config's `model_type` (else `architectures`): Qwen3.5 (qwen3_5, qwen3_5_moe) or a dense
    LLaMA-like (llama, qwen2, qwen3). Weights: the directory's safetensors, else its `model.pt` state dict (HF
    names); `load_format="dummy"` with weight_dir None makes random ones. `device` and `engine_kwargs` are
    EngineArgs fields, with its defaults (device: cuda when available; dtype: bf16 on GPU, fp32 on CPU;
    max_model_len: the model's max_position_embeddings up to 32768; max_num_seqs: the requests it can hold at
    once); it has no prefix cache. On a GPU the engine is warm when returned (LogitsEngine.warm_up: decode calls of
    any batch size up to max_num_seqs, prefill calls of up to max_num_batched_tokens tokens); `warm_up=False` skips
    that (tests). `creation_s` on the engine: how long this took.
    Under torchrun every rank must make the same calls (tensor parallel)."""
    t0 = time.perf_counter()
    args = EngineArgs(model=weight_dir or "", device=device, prefix_cache=False, **engine_kwargs)
    parallel.init_distributed(args.device_type)
    engine = LogitsEngine(ModelRunner(ModelConfig.from_dict(model_config), args, weight_dir))
    if args.warm_up and needs_warm_up(engine.runner):
        engine.warm_up(args.max_num_batched_tokens)
    engine.creation_s = time.perf_counter() - t0
    if parallel.is_driver():
        log.info("create_engine: %.1f s (weights, caches, CUDA graphs, warm-up)", engine.creation_s)
    return engine
