"""The engine: requests in, tokens and text out.

Every rank builds an LLMEngine (after dist.parallel.init_distributed) and with it a ModelRunner and a Sampler. Rank 0
also owns the tokenizer, the scheduler and the request records; its step() is

    schedule -> broadcast the plan and its sampling step (one list of integers) -> forward -> sample -> postprocess

while the other ranks sit in run_worker_loop(), executing each plan they receive. Every rank samples from its own
vocabulary slice of the logits (layers/sampler.py: a few candidates per row cross the ranks, never the logits)
and ends with the same tokens. Sampled tokens stay on the device: every rank writes them into its per-slot input
buffer, where the next step's decode rows read them; on rank 0 the same launch writes them into pinned host memory,
which the host reads after an event (no copy of its own, no wait). With overlap (the default), step() queues step
N+1 before it takes step N's tokens, so the host's scheduling, broadcast and postprocess run while the device
computes. Results are the same as without overlap (--no-overlap): the scheduler counts tokens when it schedules
them, so it never waits for a value; a request that stops on a stop token or string at step N has one more row
queued at N+1, whose token is dropped (its slot and blocks are reused only by steps queued after that one).

The one postprocess (_postprocess) takes each sampled token once: it appends it to its request's record, which
detokenizes and checks stop tokens, stop strings and max_tokens; a finished request is freed there. A request that
does not stream (add_request(..., stream=False)) gives no output until it ends, then one with everything.

Requests are checked once, where they come in (check_request: the server, the offline LLM); the engine trusts
what add_request gets. Failure policy: what one request brings (its parameters, its text) fails that request
alone, with finish_reason "error", and never the step loop; what breaks the step itself (a forward that raises, a
collective that never returns because a rank is frozen or dead) ends the whole job, loudly, so torchrun exits
non-zero and no server keeps saying it is healthy while it cannot serve. The asyncio front end is
qwen35/async_engine.py.
"""
from __future__ import annotations

import argparse
import gc
import logging
import time
from dataclasses import dataclass, fields
from itertools import chain

import torch

from dist import parallel
from layers.backend import on_compile
from layers.deltanet_prefill import CHUNK
from layers.sampler import Sampler, SamplingStep, stream_key
from qwen35.config import ModelConfig
from qwen35.engine_config import DEFAULT_MAX_MODEL_LEN, DTYPES, resolve_device
from scheduler.plan import StepPlan
from scheduler.request import Request, RequestLimits, RequestOutput, ShortWay
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, ScheduledStep

__all__ = ["EngineArgs", "LLMEngine", "RequestOutput"]
log = logging.getLogger("qwen35.engine")
# the postprocess takes the decode rows' tokens at once (ShortWay) from this many rows on: with fewer, a take_token per
# row costs a host that has waited for the device no more (what the batched way saves per row is outweighed by the
# more distinct code it runs once per step, which such a host finds out of its caches)
SHORT_WAY_ROWS = 32


@dataclass
class EngineArgs:
    model: str
    tp: int | None = None                     # None: WORLD_SIZE
    dtype: str | None = None                  # None / "auto": bfloat16 on cuda, float32 on cpu
    device: str | None = None                 # None / "auto": cuda when available
    load_format: str = "safetensors"          # "safetensors" | "dummy" (random weights, no files read)
    block_size: int = 16
    max_num_seqs: int = 128                   # concurrent sequences = DeltaNet state slots
    max_num_batched_tokens: int = 8192        # tokens per forward step (decodes + prefill chunks)
    max_model_len: int | None = None          # None: min(max_position_embeddings, 32768)
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None          # None: as many as fit (gpu_memory_utilization) or are useful
    enforce_eager: bool = False
    seed: int = 0
    prefix_cache: bool = True                 # the hybrid prefix cache (scheduler/prefix_cache.py)
    prefix_cache_snapshots: int = 128         # DeltaNet state snapshots it may hold (fixed memory, LRU)
    prefix_cache_interval: int = 256          # a snapshot every this many prompt tokens (0: none)
    kernels: str | None = None                # "torch" | "fast"; None: $QWEN35_KERNELS, else fast on CUDA, torch on CPU
    overlap: bool = True                      # prepare step N+1 on the host while the device runs step N
    warm_up: bool = True                      # compile the prefill / mixed-step kernels at start (fast kernels on CUDA)

    @property
    def device_type(self) -> str:
        """For init_distributed, before anything is built (EngineConfig resolves the rest)."""
        return resolve_device(self.device).type

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", required=True, help="model directory, Hugging Face id, or preset (tiny, ...)")
        g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                       help="tensor parallel size (default: WORLD_SIZE of the torchrun job)")
        g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
        g.add_argument("--device", default="auto", help="auto, cuda or cpu")
        g.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
        g.add_argument("--block-size", type=int, default=16, help="tokens per paged-KV block")
        g.add_argument("--max-num-seqs", type=int, default=128,
                       help="most concurrent sequences (also the number of DeltaNet state slots)")
        g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + completion (default: min(max_position_embeddings, "
                            f"{DEFAULT_MAX_MODEL_LEN}))")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                       help="fraction of GPU memory for weights + caches")
        g.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV cache size (blocks)")
        g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        g.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and unseeded sampling")
        g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       help="no prefix cache: every prompt is prefilled whole")
        g.add_argument("--prefix-cache-snapshots", type=int, default=128,
                       help="DeltaNet state snapshots the prefix cache keeps (each one slot of every DeltaNet layer's "
                            "conv and recurrent state, allocated at start; least recently used go first)")
        g.add_argument("--prefix-cache-interval", type=int, default=256,
                       help="snapshot every this many prompt tokens, so that prompts sharing a prefix resume close "
                            "to where they part (a multiple of 64; 0: only at prompt ends and where prompts part)")
        g.add_argument("--kernels", default=None, choices=["torch", "fast"],
                       help="torch: reference ops; fast: fused Triton kernels (default: $QWEN35_KERNELS, else fast "
                            "on CUDA, torch on the CPU)")
        g.add_argument("--no-overlap", dest="overlap", action="store_false",
                       help="run each step to its end before preparing the next (same tokens, host time exposed)")
        g.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                       help="skip the start-up steps that compile every prefill and mixed-step kernel variant (they "
                            "are then compiled, ~1 s each, by the first requests that need them)")
        return parser

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})



@dataclass
class _Launched:
    """A step queued on the device: the requests of its logits rows, and their tokens on the way to the host."""
    sampled: list[Request]
    tokens: torch.Tensor | None     # [n] int64 on the host (pinned on a GPU), written by the device (feed kernel)
    ready: torch.cuda.Event | None  # recorded after the step (its tokens written: GPU only)
    # the decode batch's rows (the first rows; scheduler.DecodeBatch) when none of their tokens can be its
    # request's last (max_tokens): the postprocess's short way for many rows at once (ShortWay) may take them
    decode_rows: list[Request] | None = None

    def host_tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist() if self.tokens is not None else []


class LLMEngine:
    """Not thread-safe: one thread calls it (AsyncEngine's loop thread, or the offline LLM's caller), except
    check_request, which reads only constants."""

    def __init__(self, args: EngineArgs):
        from qwen35.hub import resolve_model
        from qwen35.runner import ModelRunner

        self.args = args
        world = parallel.tp_size()
        if (args.tp or world) != world:
            raise ValueError(f"tp={args.tp} but the job has {world} processes; launch with "
                             f"torchrun --nproc-per-node {args.tp}")
        # one rank resolves (a hub download or a synthetic write happens once), the others get its path
        self.model_dir = parallel.broadcast_object(
            resolve_model(args.model, load_format=args.load_format) if parallel.is_driver() else None)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.config.check_tp(world)
        if args.prefix_cache and (args.prefix_cache_snapshots < 1 or args.prefix_cache_interval < 0
                                  or args.prefix_cache_interval % CHUNK):
            raise ValueError(f"--prefix-cache-snapshots must be >= 1 (got {args.prefix_cache_snapshots}) and "
                             f"--prefix-cache-interval a multiple of {CHUNK} (got {args.prefix_cache_interval}); "
                             "--no-prefix-cache turns the cache off")
        self.runner = ModelRunner(
            self.config, model_dir=self.model_dir, load_format=args.load_format, dtype=args.dtype,
            device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
            num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager, seed=args.seed,
            num_snapshot_slots=args.prefix_cache_snapshots if args.prefix_cache else 0, kernels=args.kernels)
        self.device, self.max_model_len = self.runner.device, self.runner.max_model_len
        self.late_compiles, self._stop_compile_log = 0, lambda: None  # Triton compiles after start (and warm-up)
        compiles = self.device.type == "cuda" and self.runner.kernels == "fast"  # Triton compiles (not interprets)
        warm_up = args.warm_up and compiles
        if warm_up:
            if parallel.is_driver():
                log.info("warm-up: compiling the prefill and mixed-step kernels (first start: a minute or two; "
                         "Triton's disk cache makes later starts quick)")
            t0 = time.perf_counter()
            n = self.runner.warm_up(args.max_num_batched_tokens)  # every rank: the same plans
            if parallel.is_driver():
                log.info("warm-up: %d prefill and mixed steps (up to %d tokens) in %.1f s", n,
                         args.max_num_batched_tokens, time.perf_counter() - t0)
        self._shut_down = False
        num_real = None
        if parallel.is_driver():
            from qwen35.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir)
            self.tokenizer.warm_detokenizer()  # no token's text is worked out for the first time while streaming
            num_real = min(self.tokenizer.num_real_tokens, self.config.vocab_size)
        # every rank samples its vocabulary slice (the tokens then feed the next step on every rank); per-slot
        # settings for every slot a row may name, the scratch slot of padded graph rows included
        self.sampler = Sampler(parallel.broadcast_object(num_real), self.config.vocab_size,
                               self.runner.scratch_slot + 1, self.device)
        if warm_up:
            self.sampler.warm_up()
        # the sampling tails of the decode graphs are captured with it; rank 0's tokens reach the host through the
        # runner's pinned ring
        self.runner.attach_sampler(self.sampler, host_ring=parallel.is_driver() and self.device.type == "cuda")
        if compiles and parallel.is_driver():
            self._stop_compile_log = on_compile(self._log_late_compile)
        if warm_up:  # serving: what start-up leaves alive (the model's modules and parameters, the compiled
            # kernels) lives as long as the engine; out of the collector's generations, so that a full collection
            # mid-serving does not walk it again (undone at shutdown)
            gc.collect()
            gc.freeze()
        if not parallel.is_driver():
            return
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or self.config.eos_token_ids)
        self.limits = RequestLimits(self.config.vocab_size, self.max_model_len, self.runner.num_kv_blocks,
                                    self.runner.block_size)
        self.scheduler = Scheduler(self.runner.num_kv_blocks, self.runner.block_size, self.runner.num_state_slots,
                                   args.max_num_seqs, args.max_num_batched_tokens, self.runner.snapshot_slots,
                                   args.prefix_cache_interval, CHUNK, stateless=not self.runner.gdn_layers)
        self._admissions = 0  # requests admitted so far: an unseeded request's noise key mixes in its number
        self._pin = self.device.type == "cuda"
        if self._pin:
            # allocated once: a step's tokens land in a half of the runner's pinned ring and an event marks their
            # arrival, each reused after the step that used it last has been taken (postprocessed): overlap holds
            # two steps at most.
            # The events are recorded on the stream the engine was built on (the device's default stream, which
            # the thread calling step() uses too): torch.cuda.current_stream() at every record cost the host ~20 us
            # a step (H200 host, 2026-11-26). The tokens reach the runner's pinned ring from the device (the feed
            # kernel writes them there, in the tail graph or after eager sampling), no copy queued by the host.
            self._stream = torch.cuda.current_stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(2)]
        self.overlap = args.overlap
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._in_flight: _Launched | None = None
        self._batch_hints: tuple = (None, None)  # the decode rows _sampling_step saw last, and their hints
        self._short_way: ShortWay | None = None  # the postprocess's, for the decode rows it saw last
        self._failed: list[RequestOutput] = []  # requests that failed while their step was being queued
        self.total_prompt_tokens = 0      # prompt tokens prefilled
        self.total_completion_tokens = 0  # tokens sampled
        self.num_steps = 0
        self.last_step_time = 0.0         # seconds, the last step() call
        self.timer = None  # an opt-in observer of the step loop (the bench's StepTimer, qwen35/bench/step_timer.py)

    # ---- rank 0 API ---------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError when the request can never run; changes nothing (any thread)."""
        self.limits.check(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a request that check_request accepted (not checked again). Its id must be free: a second record
        under one id would leave the first unreachable, so that is refused (ValueError). With stream=False its only
        output is the whole completion, when it ends (no output object per token)."""
        from qwen35.tokenizer import IncrementalDetokenizer

        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, list(prompt_ids), params, self.eos_token_ids,
                      IncrementalDetokenizer(self.tokenizer, prompt_ids, keep_text=False), stream)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's resources at once; returns its final output (finish_reason "abort"), or None for
        an unknown or already finished id. A step already queued may still run its rows: its token is dropped."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.free(req)
        req.abort()
        if not self.requests:  # a queued step holds only rows of ended requests: nothing to collect from it
            self._in_flight = None
        return req.take_output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Queue the next step, then take the tokens of the step queued before it (overlap) or of this one."""
        t0 = time.perf_counter()
        launched = self._launch()
        done = launched
        if self.overlap:
            done, self._in_flight = self._in_flight, launched
        outputs = self._postprocess(done) if done is not None else []
        if self._failed:
            outputs, self._failed = outputs + self._failed, []
        self.last_step_time = time.perf_counter() - t0
        if self.timer is not None:
            self.timer.step_done(self.last_step_time)
        return outputs

    def _launch(self) -> _Launched | None:
        """Schedule the next step and queue it on every rank: forward, sampling, tokens to the input buffer."""
        step = self.scheduler.schedule()
        plan = step.plan
        if not plan.num_seqs:
            return None
        k = self.num_steps + 1  # this step's number: it picks the step's event and token buffer
        timer = self.timer
        if timer is not None:
            timer.launch(k)
        sampling = self._sampling_step(step, self._bind(step) if step.admitted else [])
        _send(plan, sampling)
        half = k % 2 if self._pin and step.sampled else None  # the ring half the step's tokens land in
        if timer is None:
            tokens = self._run_step(plan, sampling, half)
        else:
            tokens = timer.forward(self._run_step, plan, sampling, half)
        self.total_prompt_tokens += step.num_prompt_tokens
        self.num_steps = k
        batch = None if step.decode_ends else step.decode_rows
        if not self._pin:
            return _Launched(step.sampled, tokens, None, decode_rows=batch)
        ready = self._ready[k % 2] if timer is None else timer.ready_event(k, self._ready[k % 2])
        ready.record(self._stream)
        host = self.runner.host_view(half, len(step.sampled)) if tokens is not None else None
        return _Launched(step.sampled, host, ready, batch)

    def _bind(self, step: ScheduledStep) -> list[tuple[int, tuple[float, float, float], int]]:
        """The sampling state of the requests admitted in `step`, for every rank's sampler: (slot, (temperature,
        top_k, top_p), noise key). A request whose parameters make this raise fails alone. The slots come from the
        plan (the admitted requests' rows are its last ones): one whose only token this step samples (max_tokens 1)
        has already been freed by the scheduler, its slot still the row's."""
        rows, admitted = [], step.admitted
        slots = step.plan.state_slots[len(step.plan.state_slots) - len(admitted):]
        for req, slot in zip(admitted, slots):
            try:
                # the values as the sampler's float32 tensors hold them (what is not a number fails here, alone)
                row = tuple(torch.tensor(req.params.sampler_row(), dtype=torch.float32).tolist())
                rows.append((slot, row, stream_key(req.params.seed, self.args.seed, self._admissions)))
                self._admissions += 1
            except Exception as e:
                self._fail(req, e)
        return rows

    def _sampling_step(self, step: ScheduledStep, admitted: list) -> SamplingStep:
        """What every rank's sampler needs for this step besides the plan: the admitted slots' settings, and what
        only the records know (any sampled row, any top-k / top-p, stop ids suppressed before min_tokens). The rows
        of the decode batch (scheduler.DecodeBatch: the same requests step after step) are looked at once."""
        out = SamplingStep(admitted=admitted)
        rows, first = step.sampled, 0
        batch = step.decode_rows
        if batch is not None:
            if self._batch_hints[0] is not batch:  # the same list object: the same requests (scheduler.DecodeBatch)
                self._batch_hints = (batch, _hints(batch, 0))
            out.greedy_only, out.any_top_k, out.any_top_p, with_min = self._batch_hints[1]
            for i, req in with_min:
                out.suppress += [(i, t) for t in req.suppressed_ids(req.num_scheduled - 1)]
            first = len(batch)
            if first == len(rows):
                return out
        greedy_only, any_top_k, any_top_p, with_min = _hints(rows[first:], first)
        out.greedy_only &= greedy_only
        out.any_top_k |= any_top_k
        out.any_top_p |= any_top_p
        for i, req in with_min:
            # the completion tokens before this row's
            out.suppress += [(i, t) for t in req.suppressed_ids(req.num_scheduled - 1)]
        return out

    def _run_step(self, plan: StepPlan, sampling: SamplingStep, half: int | None = None) -> torch.Tensor | None:
        """Every rank: the forward, then sampling from this rank's vocabulary slice; the tokens ([n] int64 on the
        device, the same on every rank) become the slots' next input, and on rank 0 (`half`) land in that half of
        the runner's host ring (runner.sample_step). Queued, no host sync."""
        self.sampler.admit(sampling)
        return self.runner.sample_step(plan, sampling, half)

    def _postprocess(self, launched: _Launched) -> list[RequestOutput]:
        """The one place a sampled token reaches its request: appended once (detokenized, stop tokens, stop strings
        and max_tokens checked); a request that finishes is freed here. An error of one request (from its output
        handling) ends that request alone with finish_reason "error". The decode batch's rows, where none of them
        can reach max_tokens, are taken together where they take the records' shortest way (ShortWay: the same
        outputs as a take_token per row, in the same order), the others one by one."""
        tokens = launched.host_tokens() if self.timer is None else self.timer.wait(launched)
        outputs = []
        add = outputs.append
        rows, short = launched.sampled, None
        pairs = zip(rows, tokens)
        batch = launched.decode_rows
        if batch is not None and len(batch) >= SHORT_WAY_ROWS:  # the decode rows at once (ShortWay.take)
            short = self._short_way
            if short is None or short.rows is not batch:
                short = self._short_way = ShortWay(batch)
            n = len(batch)
            pairs = short.take(tokens, outputs)  # the rows it leaves, each in its turn
            if len(rows) > n:
                pairs = chain(pairs, zip(rows[n:], tokens[n:]))
        taken = 0
        for req, token in pairs:  # one by one
            if req.finish_reason is not None:  # aborted, failed or stopped while this step was queued: dropped
                continue
            try:
                out = req.take_token(token)  # append_token, then take_output
            except Exception as e:
                self._fail(req, e)
                continue
            taken += 1
            if out is None:  # a request that does not stream, still running
                continue
            if out.finished:
                self.scheduler.free(req)
                del self.requests[req.request_id]
            add(out)
        self.total_completion_tokens += taken + (short.taken if short is not None else 0)
        return outputs

    def _fail(self, req: Request, error: Exception) -> None:
        """End one request with an error of its own; its final output goes out with this step's."""
        log.error("request %s failed: %s: %s", req.request_id, type(error).__name__, error)
        self.scheduler.free(req)
        req.fail(error)
        del self.requests[req.request_id]
        self._failed.append(req.take_output())

    def heartbeat(self) -> None:
        """Tell idle worker ranks we are alive (their broadcast wait would otherwise hit the group timeout)."""
        _send(StepPlan(command="idle"))

    def stats(self) -> dict:
        s = self.scheduler
        cached = s.cache.num_blocks if s.cache else 0
        hit_tokens = s.cache.hit_tokens if s.cache else 0
        return {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "total_prompt_tokens": self.total_prompt_tokens + hit_tokens,  # prefilled or served from the cache
            "total_completion_tokens": self.total_completion_tokens,
            "num_steps": self.num_steps, "last_step_time_s": self.last_step_time,
            # blocks held by running requests; the prefix cache's own (freed on demand) are counted apart
            "kv_blocks_used": s.blocks.num_used - cached, "kv_blocks_total": s.blocks.size,
            "state_slots_used": s.slots.num_used, "state_slots_total": s.slots.size,
            "prefix_cache_snapshots": s.cache.num_snapshots if s.cache else 0,
            "prefix_cache_blocks": cached,
            "prefix_cache_hits": s.cache.hits if s.cache else 0,
            "prefix_cache_hit_tokens": hit_tokens,
        }

    def _log_late_compile(self, kernel: str) -> None:
        """A Triton compile after start: a kernel variant the warm-up did not meet (a gap in
        ModelRunner.warm_up_plans, or --no-warm-up), paid by the requests of this step (~1 s)."""
        self.late_compiles += 1
        log.warning("Triton compiled a kernel after start (%d so far; ~1 s in the middle of serving): %s",
                    self.late_compiles, kernel[:400])

    def shutdown(self) -> None:
        """Rank 0: release the worker ranks from run_worker_loop()."""
        if not self._shut_down and parallel.is_driver():
            self._shut_down = True
            self._stop_compile_log()
            gc.unfreeze()
            _send(StepPlan(command="exit"))

    # ---- other ranks ------------------------------------------------------------------------------------------
    def run_worker_loop(self) -> None:
        while True:
            plan, sampling = _receive()
            if plan.command == "exit":
                gc.unfreeze()
                return
            if plan.command == "step":
                self._run_step(plan, sampling)


def _hints(rows: list[Request], first: int) -> tuple[bool, bool, bool, list[tuple[int, Request]]]:
    """Over requests sampled from rows first, first + 1, ...: (every one greedy, any with top-k, any with top-p,
    the (row, request) of those with min_tokens). A request already finished (failed while being bound) is left
    out: its row's token is dropped."""
    greedy_only, any_top_k, any_top_p, with_min = True, False, False, []
    for i, req in enumerate(rows, first):
        if req.finish_reason is not None:
            continue
        p = req.params
        if not p.greedy:
            greedy_only = False
            any_top_k |= p.top_k > 0
            any_top_p |= p.top_p < 1.0
        if p.min_tokens:
            with_min.append((i, req))
    return greedy_only, any_top_k, any_top_p, with_min


def _send(plan: StepPlan, sampling: SamplingStep | None = None) -> None:
    """Rank 0: the plan and its sampling step to every rank, in one broadcast_ints (shared memory on one host, else
    gloo; sampling step first, behind its length). Nothing to send with one rank: no encoding either."""
    if parallel.tp_size() == 1:
        return
    head = (sampling or SamplingStep()).encode()
    message = [len(head)]
    message += head
    message += plan.encode()
    parallel.broadcast_ints(message)


def _receive() -> tuple[StepPlan, SamplingStep]:
    """Worker ranks: what _send sent."""
    v = parallel.broadcast_ints()
    n = v[0]
    return StepPlan.decode(v[1 + n:]), SamplingStep.decode(v[1:1 + n])
