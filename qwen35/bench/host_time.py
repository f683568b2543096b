"""Host time per decode step outside the forward (issue #10), on any machine: the `cpu_ms` of `qwen35.bench --mode
record` (profile_steps: the engine's step loop timed by a StepTimer) without a GPU, for a model that runs anywhere.

    python -m qwen35.bench.host_time [--model tiny] [--batch-sizes 1,8,64] [--steps 200] [--reps 3]
        [--forward real|none|sleep]
    python -m qwen35.bench.host_time --device cuda --model qwen3.5-35b-a3b --load-format dummy --cprofile 30
    python -m qwen35.bench.host_time --forward sleep --breakdown  # the host time split into phases, us per step
    torchrun --nproc-per-node 2 -m qwen35.bench.host_time --forward sleep  # rank 0's host time at TP=2 (plans sent)

Per batch size: `batch` requests of 16 random prompt tokens, greedy, ignore_eos, max_tokens steps + 1; the prefill
steps are not timed, then every decode step until all have finished is (as the record mode does it). The best of
--reps runs is printed (the host is shared; the least disturbed run is the most telling). `--forward real` runs the
model (torch kernels: the forward's own work on this CPU evicts the host's data from the caches between steps);
`none` replaces the forward and sampling by random tokens (what the step timer measures is unchanged: the forward is
not in cpu_ms), the host's work alone with warm caches; `sleep` is `none` after a sleep of --sleep-ms, as a host that
waits for a GPU sees it.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dist import parallel
from qwen35.bench.args import ints
from qwen35.bench.engine_runs import profile_steps
from qwen35.engine import EngineArgs, LLMEngine


def stub_forward(engine: LLMEngine, sleep_s: float = 0.0, seed: int = 0) -> None:
    """The engine's forward and sampling replaced by random tokens (ids 1000..49999, as ordinary text would give),
    after a sleep of `sleep_s`."""
    gen = torch.Generator().manual_seed(seed)

    def run_step(plan, sampling, half=None):
        if sleep_s:
            time.sleep(sleep_s)
        n = sum(plan.want_logits)
        tokens = torch.randint(1000, 50000, (n,), generator=gen) if n else None
        if half is not None and tokens is not None:  # (a GPU engine reads them from the runner's host ring)
            engine.runner.host_view(half, n).copy_(tokens)
        return tokens

    engine._run_step = run_step  # (on a worker rank: what it runs for each plan it receives)


class Breakdown:
    """Where rank 0's host time per step goes, phase by phase: timers wrapped around the engine's own parts
    (schedule, the sampling step, the plan broadcast, the postprocess less its wait; `launch other`: the rest of
    _launch outside the forward, its event records; `step other`: the rest of step()), and the parts of queueing
    the forward (forward_ms; the runner's: prepare, the decode graph with its rows, the tail graph, the eager LM
    head, sampling and feed where no tail ran them). Each wrapper costs the host ~0.1-1 us (more when its code is
    out of the caches), so the phases sum to more than cpu_ms. The sums restart with each StepTimer the engine is
    given (profile_steps installs one after its untimed prefill steps), and are reported over the last one's."""

    PHASES = ("schedule", "sampling_step", "bind", "send", "postprocess", "launch_other", "step_other")
    FORWARD = ("prepare", "graph", "tail", "logits", "sample", "feed")

    def __init__(self, engine: LLMEngine):
        import qwen35.engine as engine_module
        self.engine, self._timer, self.sums = engine, engine.timer, self._zeros()
        self._module, self._send = engine_module, engine_module._send
        sched = engine.scheduler
        runner, graphs = engine.runner, engine.runner.graphs
        parts = [(sched, "schedule", "schedule"), (engine, "_sampling_step", "sampling_step"), (engine, "_bind", "bind"),
                 (engine, "_postprocess", "postprocess"), (engine, "_launch", "launch"),
                 (runner, "prepare", "prepare"), (runner.model, "compute_logits", "logits"),
                 (engine.sampler, "sample", "sample"), (runner, "_feed_tokens", "feed")]
        if graphs is not None:
            parts += [(graphs, "run", "graph"), (graphs, "run_tail", "tail")]
        self._saved = [(obj, name) for obj, name, _ in parts]
        for obj, name, key in parts:
            setattr(obj, name, self._timed(getattr(obj, name), key))
        engine_module._send = self._timed(self._send, "send")

    def _timed(self, fn, key: str):
        clock, engine = time.perf_counter, self.engine

        def run(*a, **k):
            if engine.timer is not self._timer:
                self._timer, self.sums = engine.timer, self._zeros()
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                self.sums[key] += clock() - t0
        return run

    def _zeros(self) -> dict:
        return dict.fromkeys(self.PHASES + self.FORWARD + ("launch",), 0.0)

    def close(self) -> None:
        for obj, name in self._saved:
            delattr(obj, name)  # back to the class's method
        self._module._send = self._send

    def per_step_us(self) -> dict:
        """us per step of each phase, over the steps the last StepTimer counted."""
        d, times = dict(self.sums), self._timer
        n = max(1, times.steps)
        d["forward"], d["wait"], d["host"] = times.forward_s, times.wait_s, times.host_s
        d["postprocess"] -= d["wait"]
        d["launch_other"] = d["launch"] - d["schedule"] - d["sampling_step"] - d["bind"] - d["send"] - d["forward"]
        d["step_other"] = d["host"] - d["launch_other"] - d["schedule"] - d["sampling_step"] - d["bind"] - \
            d["send"] - d["postprocess"]
        return {k: round(1e6 * d[k] / n, 2) for k in self.PHASES + ("host", "forward") + self.FORWARD}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="qwen35.bench.host_time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per run")
    ap.add_argument("--reps", type=int, default=3, help="runs per batch size (the best is reported)")
    ap.add_argument("--forward", choices=["real", "none", "sleep"], default="real")
    ap.add_argument("--sleep-ms", type=float, default=10.0, help="--forward sleep: the forward's stand-in")
    ap.add_argument("--no-stream", dest="stream", action="store_false",
                    help="requests that do not stream (as the users' evaluations post them): one output each, at "
                         "its end")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the host time around a GPU's forward")
    ap.add_argument("--load-format", default=None, help="dummy: random weights (a full-size preset on a GPU)")
    ap.add_argument("--breakdown", action="store_true",
                    help="then one more run per batch size with the host time split into phases (us per step)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="then one more run at the largest batch under cProfile: the N functions of most own time")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parallel.init_distributed("cpu" if args.device == "cpu" else "cuda")
    sizes = ints(args.batch_sizes)
    extra = {"load_format": args.load_format} if args.load_format else {}
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, max_num_seqs=max(sizes), max_model_len=1024,
                                  speculative_tokens=0, **extra))  # (a plain step's host time)
    if args.forward != "real":
        stub_forward(engine, args.sleep_ms / 1e3 if args.forward == "sleep" else 0.0)
    if not parallel.is_driver():  # TP > 1 (torchrun): the other ranks receive and run every plan
        engine.run_worker_loop()
        parallel.destroy()
        return
    rng = random.Random(0)
    profile_steps(engine, min(8, max(sizes)), 16, 16, rng)  # warm-up: first-use costs stay out
    rows = []
    for b in sizes:
        runs = [profile_steps(engine, b, 16, args.steps, rng, args.stream) for _ in range(args.reps)]
        best = min(runs, key=lambda r: r["cpu_ms"])
        rows.append({"batch": b, "cpu_ms": round(best["cpu_ms"], 4), "steps": best["steps"],
                     "runs_cpu_ms": [round(r["cpu_ms"], 4) for r in runs]})
        print(json.dumps(rows[-1]), flush=True)
    if args.breakdown:
        parts = Breakdown(engine)
        for b in sizes:
            profile_steps(engine, b, 16, args.steps, rng, args.stream)
            print(json.dumps({"batch": b, "us_per_step": parts.per_step_us()}), flush=True)
        parts.close()
    if args.cprofile:  # where the host's time per step goes (the forward and the wait for tokens show too)
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        profile_steps(engine, max(sizes), 16, args.steps, rng, args.stream)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    engine.shutdown()
    parallel.destroy()


if __name__ == "__main__":
    main()
