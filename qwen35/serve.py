"""Server entry point, one process per GPU:

    torchrun --nproc-per-node N -m qwen35.serve --port 8000 --model DIR|HUB_ID|PRESET [--host H]
             [--api-key-file FILE] [--served-model-name NAME] [--max-request-bytes B] [--step-timeout S]
             [engine flags: see EngineArgs]

Every rank builds the LLMEngine; rank 0 serves HTTP (server.build_app on uvicorn) and drives the step loop, the
other ranks run the worker loop until rank 0 shuts the engine down. Rank 0 takes its port before loading the model,
so a busy port fails the start at once instead of after minutes of loading. SIGTERM/SIGINT stop uvicorn on rank 0:
every request in flight ends at once with an error (a stream with a final error event and `data: [DONE]`), then
the engine shuts down, which ends the worker loops. A rank that fails exits non-zero and torchrun ends the rest; a
rank that hangs is caught by rank 0's watchdog (--step-timeout), which exits non-zero too.
The API key comes from --api-key, --api-key-file or the QWEN35_API_KEY environment variable (first found), and is
never logged; prefer the file or the environment, since a command line is visible to every user in `ps`.
`./start.sh` wraps this for daily use.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

import uvicorn

import server
from dist import parallel
from qwen35.async_engine import AsyncEngine
from qwen35.engine import EngineArgs, LLMEngine
from qwen35.spec_costs import measure_at_start

log = logging.getLogger("qwen35.serve")
API_KEY_ENV = "QWEN35_API_KEY"
# The longest a step (or the collective inside it) may take before the job counts as hung. Real steps take
# milliseconds to about a second (at most max_num_batched_tokens tokens); the first ones may also compile Triton
# kernels, tens of seconds. 300 s is far past any of that, yet ends a job with a frozen rank in 5 minutes rather
# than the process group's 30-minute timeout.
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_KEEP_ALIVE_S = 300.0  # uvicorn's 5 s closed connections a client's pool still held between its bursts, and a
                              # request sent as the server closed its connection failed with a read error (one of 448
                              # in the users' procedure at TP=2, 2x H100, 2026-11-27)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m qwen35.serve",
                                description="qwen35 OpenAI-compatible server (launch with torchrun -m qwen35.serve "
                                            "for tensor parallelism, or through ./start.sh)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /invocations; visible in ps, so prefer "
                        f"--api-key-file or ${API_KEY_ENV}")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file (surrounding whitespace "
                                                        "dropped)")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models and responses (default --model)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-request-bytes", type=int, default=server.DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get HTTP 413")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle client connection stays open")
    p.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds a step may take before the job counts as hung (a frozen or dead rank): /health "
                        "turns 503, requests fail and the process exits non-zero (0: no watchdog)")
    EngineArgs.add_cli_args(p)
    return p.parse_args(argv)


def api_key(ns: argparse.Namespace) -> str | None:
    if ns.api_key:
        return ns.api_key
    if ns.api_key_file:
        try:
            with open(ns.api_key_file) as f:
                key = f.read().strip()
        except OSError as e:
            raise SystemExit(f"qwen35.serve: cannot read the API key file {ns.api_key_file}: {e.strerror}")
        if not key:
            raise SystemExit(f"qwen35.serve: the API key file {ns.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads (as uvicorn would: SO_REUSEADDR, IPv6 for a ':' host)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"qwen35.serve: cannot listen on {host}:{port}: {e.strerror} (is another server there?)")
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn that first ends every request in flight with an error, so that a stream ends with a final error
    event and [DONE] at once instead of being cut after the graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        self.engine.fail_all("the server is shutting down")
        await super().shutdown(sockets)


def main(argv=None) -> None:
    ns = parse_args(argv)
    args = EngineArgs.from_cli(ns)
    key = api_key(ns)  # before anything loads: a missing key file fails the start at once
    rank, world = parallel.init_distributed(args.device_type)  # NCCL on GPUs, gloo on the CPU
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    sock = bind(ns.host, ns.port) if rank == 0 else None
    log.info("loading %s on %s (tensor parallel %d, pid %d)", ns.model, args.device_type, world, os.getpid())
    engine = LLMEngine(args)
    if rank != 0:
        # torchrun forwards SIGTERM to every rank; a worker waits for rank 0's exit command instead of dying in
        # the middle of a collective (if rank 0 dies, the broadcast fails and this rank exits too)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.run_worker_loop()
        log.info("worker exiting")
        parallel.destroy()
        return

    measure_at_start(engine)  # (the other ranks are in their worker loop now: rank 0 drives the steps)
    async_engine = AsyncEngine(engine, step_timeout_s=ns.step_timeout or None)
    name = ns.served_model_name or ns.model
    app = server.build_app(async_engine, engine.tokenizer, name, engine.max_model_len, api_key=key,
                           max_request_bytes=ns.max_request_bytes)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level="info", access_log=ns.access_log,
                            timeout_keep_alive=ns.keep_alive_timeout, timeout_graceful_shutdown=5)
    # uvicorn re-raises the signal that stopped it once it is done: no-op handlers let the engine shut down after
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("engine ready (%s, max_model_len %d); serving it as %r on http://%s:%d%s", engine.model_dir,
             engine.max_model_len, name, ns.host, ns.port, " (API key required)" if key else "")
    try:
        _Uvicorn(config, async_engine).run(sockets=[sock])
    finally:
        log.info("shutting down the engine")
        async_engine.shutdown()
        parallel.destroy()
    log.info("bye")


if __name__ == "__main__":
    main()
