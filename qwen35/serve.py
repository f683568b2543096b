"""Server entry point, one process per GPU:

    torchrun --nproc-per-node N -m qwen35.serve --port 8000 --model DIR|HUB_ID|PRESET [--host H] [--api-key KEY]
             [--served-model-name NAME] [engine flags: see EngineArgs]

Every rank builds the LLMEngine; rank 0 serves HTTP (server.build_app on uvicorn) and drives the step loop, the
other ranks run the worker loop until rank 0 shuts the engine down. SIGTERM/SIGINT stop uvicorn on rank 0, which
then shuts the engine down, which ends the worker loops. A rank that fails exits non-zero and torchrun ends the rest.
`./start.sh` wraps this for daily use.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal

import uvicorn

import server
from dist import parallel
from qwen35.engine import AsyncEngine, EngineArgs, LLMEngine

log = logging.getLogger("qwen35.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="qwen35 OpenAI-compatible server (launch with torchrun)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /invocations")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models and responses (default --model)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    EngineArgs.add_cli_args(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    ns = parse_args(argv)
    args = EngineArgs.from_cli(ns)
    rank, world = parallel.init_distributed(args.device_type)  # NCCL on GPUs, gloo on the CPU
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
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

    async_engine = AsyncEngine(engine)
    name = ns.served_model_name or ns.model
    app = server.build_app(async_engine, engine.tokenizer, name, engine.max_model_len, api_key=ns.api_key)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level="info", access_log=ns.access_log,
                            timeout_graceful_shutdown=5)
    # uvicorn re-raises the signal that stopped it once it is done: no-op handlers let the engine shut down after
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("engine ready (%s, max_model_len %d); serving it as %r on http://%s:%d", engine.model_dir,
             engine.max_model_len, name, ns.host, ns.port)
    try:
        uvicorn.Server(config).run()
    finally:
        log.info("shutting down the engine")
        async_engine.shutdown()
        parallel.destroy()
    log.info("bye")


if __name__ == "__main__":
    main()
