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

The postprocess (_postprocess) hands each step's tokens to the scheduler (Scheduler.update), which takes each into
its request's record (detokenized there) and alone decides when a request ends: a stop token, a stop string, its
max_tokens-th token; an ended request is freed there. A request that does not stream (add_request(...,
stream=False)) gives no output until it ends, then one with everything.

Speculative decoding (--speculative-tokens, scheduler/speculation.py): the scheduler sets each plan's spec_k (drafts
verified) and draft_k (drafts proposed at its end); a verify step emits a run of tokens per row ([n, spec_k + 1],
-1 after the run, through the same pinned ring), which Scheduler.update takes in order. The next plan's positions
depend on how many drafts were accepted, so with a verify step in flight step() queues the next step before it
takes that one's runs only when the next is a verify step of the same rows (Scheduler.verifies_next: planned
behind, plan.spec_behind, the device adding each slot's accepted drafts to the host's positions); before any other
step it takes the runs first.

Requests are checked once, where they come in (check_request: the server, the offline LLM); the engine trusts
what add_request gets. Failure policy: what one request brings (its parameters, its text) fails that request
alone, with finish_reason "error", and never the step loop; what breaks the step itself (a forward that raises, a
collective that never returns because a rank is frozen or dead) ends the whole job, loudly, so torchrun exits
non-zero and no server keeps saying it is healthy while it cannot serve. The asyncio front end is
qwen35/async_engine.py.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from dist import parallel
from layers.backend import on_compile
from layers.deltanet_prefill import CHUNK
from layers.sampler import Sampler, SamplingStep, stream_key
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from scheduler.plan import StepPlan
from scheduler.request import Request, RequestLimits, RequestOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, ScheduledStep, sampling_hints
from scheduler.speculation import MEASURE, CostTable, SpecPolicy, model_shape

__all__ = ["EngineArgs", "LLMEngine", "RequestOutput"]
log = logging.getLogger("qwen35.engine")


@dataclass
class _Launched:
    """A step queued on the device: the requests of its logits rows, and their tokens on the way to the host."""
    sampled: list[Request]
    tokens: torch.Tensor | None  # [n] int64 on the host (pinned on a GPU), written by the device (feed kernel);
    # a verify step's [n, spec_k + 1], each row's run then -1
    ready: torch.cuda.Event | None  # recorded after the step (its tokens written: GPU only)
    spec_k: int = 0  # a verify step's drafts per row

    def host_tokens(self) -> list[int] | list[list[int]]:
        """The tokens (a verify step's: a run per row), once the device has written them."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.tokens is None:
            return []
        if self.spec_k:
            return [[t for t in row if t >= 0] for row in self.tokens.tolist()]
        return self.tokens.tolist()


class LLMEngine:
    """Not thread-safe: one thread calls it (AsyncEngine's loop thread, or the offline LLM's caller), except
    check_request, which reads only constants."""

    def __init__(self, args: EngineArgs):
        from qwen35.hub import resolve_model
        from qwen35.runner import ModelRunner

        self.args = args
        args.check()
        world = parallel.tp_size()
        if (args.tp or world) != world:
            raise ValueError(f"tp={args.tp} but the job has {world} processes; launch with "
                             f"torchrun --nproc-per-node {args.tp}")
        # one rank resolves (a hub download or a synthetic write happens once), the others get its path
        self.model_dir = parallel.broadcast_object(
            resolve_model(args.model, load_format=args.load_format) if parallel.is_driver() else None)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.config.check_tp(world)
        args.resolve_speculation(self.config, self.model_dir)
        if parallel.is_driver():
            log.info("speculative decoding: %s", f"--speculative-tokens {args.speculative_tokens}"
                     if args.speculative_tokens else "off (--speculative-tokens 0, or no MTP head, or the CPU)")
        self.runner = ModelRunner(self.config, args, self.model_dir, num_snapshot_slots=args.num_snapshot_slots)
        self.device, self.max_model_len = self.runner.device, self.runner.max_model_len
        self.late_compiles, self._stop_compile_log = 0, lambda: None  # Triton compiles after start (and warm-up)
        compiles = self.device.type == "cuda" and self.runner.kernels == "fast"  # Triton compiles (not interprets)
        warm_up = args.warm_up and compiles
        self._shut_down = False
        num_real = None
        if parallel.is_driver():
            from qwen35.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir)
            self.tokenizer.warm_detokenizer()  # no token's text is worked out for the first time while streaming
            num_real = min(self.tokenizer.num_real_tokens, self.config.vocab_size)
        num_real = parallel.broadcast_object(num_real)
        if warm_up:
            if parallel.is_driver():
                log.info("warm-up: compiling the prefill and mixed-step kernels (first start: a minute or two; "
                         "Triton's disk cache makes later starts quick)")
            t0 = time.perf_counter()
            n = self.runner.warm_up(args.max_num_batched_tokens, num_real)  # every rank: the same plans
            if parallel.is_driver():
                log.info("warm-up: %d prefill and mixed steps (up to %d tokens) in %.1f s", n,
                         args.max_num_batched_tokens, time.perf_counter() - t0)
        # every rank samples its vocabulary slice (the tokens then feed the next step on every rank); per-slot
        # settings for every slot a row may name, the scratch slot of padded graph rows included
        self.sampler = Sampler(num_real, self.config.vocab_size, self.runner.scratch_slot + 1, self.device)
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
        self.speculation = SpecPolicy(args.speculative_tokens, self._cost_table(args))
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or self.config.eos_token_ids)
        self.limits = RequestLimits(num_real, self.max_model_len, self.runner.num_kv_blocks,
                                    self.runner.block_size)
        self.scheduler = Scheduler(self.runner.num_kv_blocks, self.runner.block_size, self.runner.num_state_slots,
                                   args.max_num_seqs, args.max_num_batched_tokens, self.runner.snapshot_slots,
                                   args.prefix_cache_interval, CHUNK, stateless=not self.runner.gdn_layers,
                                   speculation=self.speculation)
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
        self._in_flight: _Launched | None = None
        self._failed: list[RequestOutput] = []  # requests that failed while their step was being queued
        self.total_prompt_tokens = 0      # prompt tokens prefilled
        self.num_steps = 0
        self.last_step_time = 0.0         # seconds, the last step() call
        self.timer = None  # an opt-in observer of the step loop (the bench's StepTimer, qwen35/bench/step_timer.py)

    # ---- rank 0 API ---------------------------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """Every request that has not ended, by id (the scheduler's)."""
        return self.scheduler.requests

    @property
    def total_completion_tokens(self) -> int:
        """Sampled tokens taken into their requests."""
        return self.scheduler.completion_tokens

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError when the request can never run; changes nothing (any thread)."""
        self.limits.check(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a request that check_request accepted (not checked again). Its id must be free: a second record
        under one id would leave the first unreachable, so that is refused (ValueError). With stream=False its only
        output is the whole completion, when it ends (no output object per token)."""
        from qwen35.tokenizer import IncrementalDetokenizer

        if request_id in self.scheduler.requests:  # (before its detokenizer is made)
            raise ValueError(f"duplicate request id {request_id!r}")
        self.scheduler.add(Request(request_id, list(prompt_ids), params, self.eos_token_ids,
                                   IncrementalDetokenizer(self.tokenizer, prompt_ids, keep_text=False), stream))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's resources at once; returns its final output (finish_reason "abort"), or None for
        an unknown or already finished id. A step already queued may still run its rows: its token is dropped."""
        out = self.scheduler.abort(request_id)
        if not self.scheduler.requests:  # a queued step holds only rows of ended requests: nothing to collect from it
            self._in_flight = None
        return out

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    @property
    def step_in_flight(self) -> bool:
        """Whether a step is queued whose tokens the next step() takes (the overlap)."""
        return self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Queue the next step, then take the tokens of the step queued before it (overlap) or of this one. A verify
        step in flight is taken first unless the next step verifies the same rows (module docstring)."""
        t0 = time.perf_counter()
        outputs, before = [], self._in_flight
        behind = before is not None and before.spec_k > 0
        if behind and not (self.overlap and self.scheduler.verifies_next()):
            outputs, before, behind = self._postprocess(before), None, False
        launched = self._launch(behind)
        if self.overlap:
            done, self._in_flight = [before], launched
        else:
            done, self._in_flight = [before, launched], None
        for d in done:
            if d is not None:
                outputs += self._postprocess(d, followed=behind and d is before)
        if self._failed:
            outputs, self._failed = outputs + self._failed, []
        self.last_step_time = time.perf_counter() - t0
        if self.timer is not None:
            self.timer.step_done(self.last_step_time)
        return outputs

    def _cost_table(self, args: EngineArgs) -> CostTable | None:
        """What `--speculative-tokens auto` chooses k by: the given table, else the one measured on this GPU kind
        at this TP (scheduler/spec_costs.json), else the placeholder; with `measures_spec_costs` set (asked for with
        --spec-cost-table measure, or no table ships for this GPU kind and TP) until the server has measured one
        at start (qwen35/spec_costs.py measure_table: it needs the other ranks in their worker loop)."""
        self.measures_spec_costs = False
        if args.speculative_tokens != "auto":
            return None
        if args.spec_cost_table and args.spec_cost_table != MEASURE:
            return CostTable.from_json(args.spec_cost_table)
        dev = self.runner.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
        table = None if args.spec_cost_table == MEASURE else CostTable.shipped(name, parallel.tp_size(),
                                                                               model_shape(self.config))
        if table is None:
            self.measures_spec_costs = dev.type == "cuda" or args.spec_cost_table == MEASURE
            log.warning("no measured speculation cost table for %s at tp=%d%s", name, parallel.tp_size(),
                        ": the server measures one at start" if self.measures_spec_costs else
                        ": --speculative-tokens auto uses the placeholder (not a measurement)")
            table = CostTable.placeholder()
        return table

    def _launch(self, behind: bool) -> _Launched | None:
        """Schedule the next step (`behind` a verify step's runs: Scheduler.schedule) and queue it on every rank:
        forward, sampling, tokens to the input buffer."""
        step = self.scheduler.schedule(behind)
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
        if not self._pin:
            return _Launched(step.sampled, tokens, None, plan.spec_k)
        ready = self._ready[k % 2] if timer is None else timer.ready_event(k, self._ready[k % 2])
        ready.record(self._stream)
        host = self.runner.host_view(half, len(step.sampled), plan.spec_k and plan.spec_k + 1) \
            if tokens is not None else None
        return _Launched(step.sampled, host, ready, plan.spec_k)

    def _bind(self, step: ScheduledStep) -> list[tuple[int, tuple[float, float, float], int]]:
        """The sampling state of the requests admitted in `step`, for every rank's sampler: (slot, (temperature,
        top_k, top_p), noise key: an unseeded request's mixes in its admission number). A request whose parameters
        make this raise fails alone. The slots come from the plan (the admitted requests' rows are its last ones): one
        whose only token this step samples (max_tokens 1) has already been freed by the scheduler, its slot still the
        row's."""
        rows, admitted = [], step.admitted
        slots = step.plan.state_slots[len(step.plan.state_slots) - len(admitted):]
        for req, slot in zip(admitted, slots):
            try:
                # the values as the sampler's float32 tensors hold them (what is not a number fails here, alone)
                row = tuple(torch.tensor(req.params.sampler_row(), dtype=torch.float32).tolist())
                rows.append((slot, row, stream_key(req.params.seed, self.args.seed, req.admission_no)))
            except Exception as e:
                self._failed.append(self.scheduler.fail(req, e))
        return rows

    def _sampling_step(self, step: ScheduledStep, admitted: list) -> SamplingStep:
        """What every rank's sampler needs for this step besides the plan: the admitted slots' settings, and what
        only the records know (any sampled row, any top-k / top-p, stop ids suppressed before min_tokens). The decode
        batch's rows come with their hints (worked out by the scheduler when the batch last changed)."""
        out = SamplingStep(admitted=admitted)
        rows, first = step.sampled, step.num_decode
        hints = [step.decode_hints] if first else []
        if len(rows) > first:
            hints.append(sampling_hints(rows[first:], first))
        for greedy_only, any_top_k, any_top_p, with_min in hints:
            out.greedy_only &= greedy_only
            out.any_top_k |= any_top_k
            out.any_top_p |= any_top_p
            for i, req in with_min:  # (num_scheduled - 1: the completion tokens before this row's)
                out.suppress += [(i, t) for t in req.suppressed_ids(req.num_scheduled - 1)]
        return out

    def _run_step(self, plan: StepPlan, sampling: SamplingStep, half: int | None = None) -> torch.Tensor | None:
        """Every rank: the forward, then sampling from this rank's vocabulary slice; the tokens ([n] int64 on the
        device, the same on every rank) become the slots' next input, and on rank 0 (`half`) land in that half of
        the runner's host ring (runner.sample_step). Queued, no host sync."""
        self.sampler.admit(sampling)
        return self.runner.sample_step(plan, sampling, half)

    def _postprocess(self, launched: _Launched, followed: bool = False) -> list[RequestOutput]:
        """A step's tokens, once on the host, to their requests (Scheduler.update: where requests end; `followed`:
        a verify step planned behind them is queued); a verify step's drafted and accepted counts."""
        tokens = launched.host_tokens() if self.timer is None else self.timer.wait(launched)
        if launched.spec_k:
            # drafts that could count: a row near its max_tokens has room for fewer; none for an ended request
            k = launched.spec_k
            rooms = [0 if r.finish_reason is not None else max(0, min(k, r.max_tokens - len(r.output_ids) - 1))
                     for r in launched.sampled]
            self.speculation.record(sum(rooms), sum(min(len(run) - 1, room) for run, room in zip(tokens, rooms)),
                                    k)
        return self.scheduler.update(launched.sampled, tokens, followed)

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
            # speculative decoding: drafts verified, and those accepted (0 when off)
            "spec_drafted_tokens": self.speculation.drafted, "spec_accepted_tokens": self.speculation.accepted,
            "spec_verify_graph_steps": self.runner.verify_counts["graph"],
            "spec_verify_eager_steps": self.runner.verify_counts["eager"],
        }

    def _log_late_compile(self, kernel: str) -> None:
        """A Triton compile after start: a kernel variant the warm-up did not meet (a gap in
        ModelRunner.warm_up_plans, or --no-warm-up), paid by the requests of this step (~1 s)."""
        self.late_compiles += 1
        # (the whole description: its specialisations, at the end, say which variant the warm-up missed)
        log.warning("Triton compiled a kernel after start (%d so far; ~1 s in the middle of serving): %s",
                    self.late_compiles, kernel)

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
