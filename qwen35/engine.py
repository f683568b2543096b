"""The engine: requests in, tokens and text out.

Every rank builds an LLMEngine (after dist.parallel.init_distributed) and with it a ModelRunner. Rank 0 also owns
the tokenizer, the scheduler and the sampler; each rank-0 step() schedules, broadcasts the StepPlan, runs the
forward, samples and updates outputs, while the other ranks sit in run_worker_loop() executing each plan they
receive. AsyncEngine drives rank 0's step loop from a background thread for the asyncio HTTP server.

Failure policy: what one request brings (its parameters, its text) fails that request alone, with finish_reason
"error", and never the step loop; what breaks the step itself (a forward that raises, a collective that never
returns because a rank is frozen or dead) ends the whole job, loudly, so torchrun exits non-zero and no server
keeps saying it is healthy while it cannot serve.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, fields

import torch

from dist import parallel
from layers.sampler import SampleRow, Sampler
from qwen35.config import ModelConfig
from qwen35.outputs import OutputState, RequestOutput
from qwen35.runner import DTYPES, resolve_dtype
from qwen35.sampling_params import SamplingParams
from scheduler.plan import StepPlan
from scheduler.request import Request
from scheduler.scheduler import Scheduler

__all__ = ["EngineArgs", "LLMEngine", "AsyncEngine", "RequestOutput", "GenerationError"]
log = logging.getLogger("qwen35.engine")


class GenerationError(RuntimeError):
    """A request ended by the engine instead of by its own stop condition: its own failure (500), or the engine
    going away under it (shutdown, a stalled step loop: 503). `status` is the HTTP status a server answers with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


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
    prefix_cache_slots: int = 64              # whole-prompt prefix cache entries (0: off)
    kernels: str | None = None                # "torch" | "fast"; None: $QWEN35_KERNELS, else fast on CUDA, torch on CPU

    @property
    def device_type(self) -> str:
        if self.device in (None, "auto"):
            return "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(self.device).type

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, torch.device(self.device_type))

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
                       help="longest prompt + completion (default: min(max_position_embeddings, 32768))")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                       help="fraction of GPU memory for weights + caches")
        g.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV cache size (blocks)")
        g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        g.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and unseeded sampling")
        g.add_argument("--prefix-cache-slots", type=int, default=64,
                       help="prompts whose state is kept for reuse by a request with the same prompt (0: off)")
        g.add_argument("--kernels", default=None, choices=["torch", "fast"],
                       help="torch: reference ops; fast: fused Triton kernels (default: $QWEN35_KERNELS, else fast "
                            "on CUDA, torch on the CPU)")
        return parser

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


@dataclass
class _Tracked:
    request: Request
    state: OutputState
    generator: torch.Generator | None


class LLMEngine:
    """Not thread-safe: one thread calls it (AsyncEngine's loop thread, or the offline LLM's caller)."""

    def __init__(self, args: EngineArgs):
        from qwen35.hub import resolve_model
        from qwen35.runner import ModelRunner

        self.args = args
        world = parallel.tp_size()
        if (args.tp or world) != world:
            raise ValueError(f"tp={args.tp} but the job has {world} processes; launch with "
                             f"torchrun --nproc-per-node {args.tp}")
        self.device_type = args.device_type
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" \
            else torch.device("cpu")
        # one rank resolves (a hub download or a synthetic write happens once), the others get its path
        self.model_dir = parallel.broadcast_object(resolve_model(args.model, load_format=args.load_format) if parallel.is_driver() else None)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.config.check_tp(world)
        limit = self.config.max_position_embeddings
        self.max_model_len = args.max_model_len or min(limit, 32768)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.runner = ModelRunner(
            self.config, model_dir=self.model_dir, load_format=args.load_format, dtype=args.torch_dtype,
            device=self.device_type, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
            num_kv_blocks=args.num_kv_blocks, enforce_eager=args.enforce_eager, seed=args.seed,
            num_snapshot_slots=args.prefix_cache_slots, kernels=args.kernels)
        self._shut_down = False
        if not parallel.is_driver():
            return
        from qwen35.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids or self.config.eos_token_ids)
        self.scheduler = Scheduler(self.runner.num_kv_blocks, self.runner.block_size, self.runner.num_state_slots,
                                   args.max_num_seqs, args.max_num_batched_tokens, self.runner.snapshot_slots)
        self.sampler = Sampler(min(self.tokenizer.num_real_tokens, self.config.vocab_size), self.device, args.seed)
        self._tracked: dict[str, _Tracked] = {}
        self.total_prompt_tokens = 0      # prompt tokens prefilled
        self.total_completion_tokens = 0  # tokens sampled
        self.num_steps = 0
        self.last_step_time = 0.0         # seconds, schedule to outputs

    # ---- rank 0 API ---------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError when the request can never run; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.config.vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {self.config.vocab_size})")
        n = len(prompt_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                             f"exceeds max_model_len ({self.max_model_len})")
        self.scheduler.check_fits(n, params.max_tokens)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        req = Request(request_id, prompt_ids, params)
        self.scheduler.add(req)  # raises on a duplicate id
        gen = self.sampler.make_generator(params.seed) if params.seed is not None else None
        state = OutputState(request_id, self.tokenizer, params, self.eos_token_ids, prompt_ids)
        self._tracked[request_id] = _Tracked(req, state, gen)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's resources at once; returns its final output (finish_reason "abort"), or None for
        an unknown or already finished id."""
        if self.scheduler.abort(request_id) is None:
            return None
        state = self._tracked.pop(request_id).state
        state.abort()
        return state.take_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan, seqs = self.scheduler.schedule()
        if not plan.num_seqs:
            return []
        parallel.broadcast_object(plan)
        logits = self.runner.execute(plan)
        rows, ids = [], []
        for s in seqs:
            if s.request.is_prefilling:
                self.total_prompt_tokens += s.num_tokens
            if s.want_logits:
                t = self._tracked[s.request.request_id]
                rows.append(SampleRow(t.request.params, t.generator, t.state.suppressed_ids()))
                ids.append(s.request.request_id)
        tokens = self.sampler.sample_each(logits, rows) if rows else []
        errors = {rid: t for rid, t in zip(ids, tokens) if isinstance(t, Exception)}
        # a failed row gets a placeholder token to keep update() aligned; its request ends below, never feeding it
        tokens = [0 if isinstance(t, Exception) else t for t in tokens]
        self.total_completion_tokens += len(tokens) - len(errors)
        outputs = [self._take_token(req, errors.get(req.request_id)) for req in self.scheduler.update(seqs, tokens)]
        self.num_steps += 1
        self.last_step_time = time.perf_counter() - t0
        return outputs

    def _take_token(self, req: Request, error: Exception | None) -> RequestOutput:
        """Hand the request's new token to its output state; an error of this request alone (from sampling, or
        raised by its own output handling) ends it with finish_reason "error" and frees it."""
        state = self._tracked[req.request_id].state
        if error is None:
            try:
                state.append(req.output_ids[-1])
            except Exception as e:
                error = e
        if error is not None:
            log.error("request %s failed: %s: %s", req.request_id, type(error).__name__, error)
            state.fail(error)
        if state.finished:
            self.scheduler.finish(req, state.finish_reason)
            del self._tracked[req.request_id]
        return state.take_output()

    def heartbeat(self) -> None:
        """Tell idle worker ranks we are alive (their broadcast wait would otherwise hit the group timeout)."""
        parallel.broadcast_object(StepPlan(command="idle"))

    def stats(self) -> dict:
        s = self.scheduler
        cached = sum(len(e.blocks) for e in s.cache.entries.values()) if s.cache else 0
        hit_tokens = s.cache.hit_tokens if s.cache else 0
        return {
            "num_running": s.num_running, "num_waiting": s.num_waiting,
            "total_prompt_tokens": self.total_prompt_tokens + hit_tokens,  # prefilled or served from the cache
            "total_completion_tokens": self.total_completion_tokens,
            "num_steps": self.num_steps, "last_step_time_s": self.last_step_time,
            # blocks held by running requests; the prefix cache's own (freed on demand) are counted apart
            "kv_blocks_used": s.blocks.num_used - cached, "kv_blocks_total": s.blocks.size,
            "state_slots_used": s.slots.num_used, "state_slots_total": s.slots.size,
            "prefix_cache_entries": len(s.cache.entries) if s.cache else 0,
            "prefix_cache_blocks": cached,
            "prefix_cache_hits": s.cache.hits if s.cache else 0,
            "prefix_cache_hit_tokens": hit_tokens,
        }

    def shutdown(self) -> None:
        """Rank 0: release the worker ranks from run_worker_loop()."""
        if not self._shut_down and parallel.is_driver():
            self._shut_down = True
            parallel.broadcast_object(StepPlan(command="exit"))

    # ---- other ranks ------------------------------------------------------------------------------------------
    def run_worker_loop(self) -> None:
        while True:
            plan = parallel.broadcast_object(None)
            if plan.command == "exit":
                return
            if plan.command == "step":
                self.runner.execute(plan)


class RequestStream:
    """Async iterator of one request's RequestOutputs (`async for`); `await` on it returns itself, so both
    `async for o in engine.generate(...)` and `s = await engine.generate(...)` work. Leaving it early (a cancelled
    task, aclose(), or dropping it) aborts the request. A request the engine ends with an error (its own failure,
    a shutdown, a stalled engine) raises GenerationError after the outputs it did produce."""

    def __init__(self, owner: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    def __await__(self):
        return self
        yield  # noqa: unreachable; makes __await__ a generator

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # CancelledError: the client went away
            self._leave()
            raise
        if isinstance(out, Exception):
            self._leave()  # frees it in the engine too (a no-op when the engine never had it)
            raise out
        if out.finished:
            self._done = True
            self._owner._streams.pop(self.request_id, None)
            if out.finish_reason == "error":
                raise GenerationError(f"generation failed: {out.error}")
        return out

    async def aclose(self) -> None:
        self._leave()

    def fail(self, error: GenerationError) -> None:
        """End the stream with `error` after what is already queued (event loop thread)."""
        if not self._done:
            self._queue.put_nowait(error)

    def _leave(self) -> None:
        if not self._done:
            self._done = True
            self._owner._streams.pop(self.request_id, None)
            self._owner.abort(self.request_id)

    def __del__(self):
        self._leave()


def exit_job(grace_s: float = 2.0) -> None:
    """What a stalled AsyncEngine does by default: give the error responses a moment to go out, then exit non-zero
    at once (the loop thread is stuck in a collective and can never be joined); torchrun then ends the other ranks
    and exits non-zero itself."""
    time.sleep(grace_s)
    sys.stderr.flush()
    os._exit(1)


class AsyncEngine:
    """Rank 0 front end for asyncio code: the step loop runs in a background thread; results are handed to each
    caller's event loop. add/abort requests travel to the loop thread through a queue, so the event loop never
    waits for a forward step. The loop thread sleeps on that queue while there is no work (the worker ranks then
    wait in their broadcast; a heartbeat reaches them every `heartbeat_s`).

    Liveness: with `step_timeout_s`, a watchdog thread times every step and collective of the loop thread. One that
    lasts longer means a rank is frozen or gone (rank 0 would otherwise wait in the collective for the process
    group's 30-minute timeout while /health said 200): the engine stops being ready (/health 503), every request
    in flight ends with an error, and `on_stall` runs (default exit_job: the process exits non-zero)."""

    def __init__(self, engine: LLMEngine, heartbeat_s: float = 60.0, step_timeout_s: float | None = None,
                 on_stall=exit_job):
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.step_timeout_s = step_timeout_s
        self._on_stall = on_stall
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe even from __del__
        # live streams by id (event loop thread); weak, so that dropping a stream reaches __del__ and aborts
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None  # the callers' event loop (the server has one)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # loop thread only
        self._failure: GenerationError | None = None  # set once the engine no longer serves (shutdown, stall)
        self._busy_since: float | None = None  # monotonic time the loop thread entered a step or collective
        self._stats = engine.stats()
        self._running = True
        self._thread = threading.Thread(target=self._main, name="qwen35-engine", daemon=True)
        self._thread.start()
        if step_timeout_s:
            threading.Thread(target=self._watchdog, name="qwen35-watchdog", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self._running and self._failure is None and self._thread.is_alive()

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Start a request; ValueError (nothing queued) when it is invalid or its id is in use, GenerationError
        (status 503) once the engine has stopped serving. Must be called from a running event loop."""
        if self._failure is not None:
            raise GenerationError(str(self._failure), self._failure.status)
        if not self.ready:
            raise RuntimeError("engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_ids = [int(t) for t in prompt_ids]
        self.engine.check_request(prompt_ids, params)
        self._loop = loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        # the loop thread holds only the queue, so dropping the stream reaches __del__ and aborts
        self._commands.put(("add", request_id, prompt_ids, params, loop, stream._queue))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def fail_all(self, message: str, status: int = 503) -> None:
        """Stop serving: every request in flight ends with GenerationError(message, status) (streams after what
        they already produced), new ones are refused and /health turns 503. Thread-safe: the server calls it on
        the event loop when it shuts down, the watchdog from its own thread."""
        self._failure = GenerationError(message, status)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
                self._loop.call_soon_threadsafe(self._fail_streams)

    def _fail_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream.fail(GenerationError(str(self._failure), self._failure.status))

    def stats(self) -> dict:
        return dict(self._stats)

    def shutdown(self) -> None:
        """Stop the loop thread and release the worker ranks."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join()
        self._running = False

    # ---- watchdog thread ----------------------------------------------------------------------------------------
    def _watchdog(self) -> None:
        period = min(1.0, self.step_timeout_s / 4)
        while self._thread.is_alive():
            time.sleep(period)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.step_timeout_s:
                message = (f"engine stalled: a step made no progress for {self.step_timeout_s:g} s (step "
                           f"{self.engine.num_steps + 1}, {self._stats['num_running']} requests running); a rank "
                           f"is frozen, dead or unreachable")
                log.error("%s; failing every request and ending the job", message)
                self.fail_all(message)
                self._on_stall()
                return

    @contextlib.contextmanager
    def _timed(self):
        """Mark the loop thread as inside a step or a collective, which the watchdog times."""
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    # ---- loop thread --------------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)  # the current device is per thread
            while self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    with self._timed():
                        outputs = self.engine.step()
                    self._deliver(outputs)
                self._stats = self.engine.stats()
        except BaseException:
            # a broken step loop must not leave clients or worker ranks hanging: die loudly, torchrun kills the rest
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(timeout=self.heartbeat_s) if block else self._commands.get_nowait()
            except queue.Empty:
                if not block:
                    return True
                with self._timed():
                    self.engine.heartbeat()
                continue
            block = False
            if cmd[0] == "add":
                _, rid, prompt_ids, params, loop, q = cmd
                try:
                    self.engine.add_request(rid, prompt_ids, params)
                except Exception as e:  # validated in generate(); a safety net: this request fails, not the loop
                    status = 400 if isinstance(e, ValueError) else 500
                    loop.call_soon_threadsafe(q.put_nowait, GenerationError(f"{type(e).__name__}: {e}", status))
                    continue
                self._sinks[rid] = (loop, q)
            elif cmd[0] == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver([out])
            else:
                self._running = False
                with self._timed():
                    self.engine.shutdown()
                return False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            loop, q = self._sinks[out.request_id] if not out.finished else self._sinks.pop(out.request_id)
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the caller's event loop is closed: nobody will read this request
                self._sinks.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)
