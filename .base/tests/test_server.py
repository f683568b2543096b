"""The HTTP server end to end: the tiny synthetic model served by ./start.sh, at TP=1 and at TP=2 (gloo).

Every check of benchmarks/check_server.py runs against both servers (shape, usage, streaming, completions, stop
strings, the 400 cases and health afterwards, disconnects freeing their slots, 64 concurrent requests). TP=1
requires an API key; TP=2 has room for 16 sequences only, so the 64 concurrent requests must queue.
Helpers here are shared with test_clients.py.
"""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import httpx
import pytest
import torch

from benchmarks import check_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sh(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["./start.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except httpx.TransportError:
        return False


def start_tiny(port: int, log: str, *flags: str) -> str:
    """Start the tiny model through start.sh and return its URL; start.sh must exit 0 with the server healthy."""
    r = start_sh("--port", str(port), "--model", "tiny", "--log", log, "--timeout", "300", *flags)
    assert r.returncode == 0, f"start.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    url = f"http://127.0.0.1:{port}"
    assert url in r.stdout and log in r.stdout, r.stdout
    assert httpx.get(url + "/health").status_code == 200
    return url


def stop_tiny(port: int, log: str, tp: int = 1) -> None:
    r = start_sh("--stop", "--port", str(port))
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert not answers(port), "still answering after ./start.sh --stop"
    text = open(log).read()  # a clean shutdown: rank 0 shut the engine down, and that released the workers
    assert "rank0 qwen35.serve: bye" in text and text.count("qwen35.serve: worker exiting") == tp - 1, text[-3000:]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, tmp_path_factory):
    tp, port = request.param, free_port()
    log = str(tmp_path_factory.mktemp(f"tp{tp}") / "server.log")
    flags = ["--api-key", API_KEY] if tp == 1 else ["--max-num-seqs", "16"]
    url = start_tiny(port, log, "--tp", str(tp), *flags)
    yield url, (API_KEY if tp == 1 else None)
    stop_tiny(port, log, tp)


@pytest.mark.parametrize("check", list(check_server.CHECKS))
def test_check_server(server, check):
    url, key = server
    argv = ["--url", url, "--only", check] + (["--api-key", key] if key else [])
    (_, ok, detail, _), = asyncio.run(check_server.run_checks(check_server.parse_args(argv)))
    assert ok, detail


def test_start_fails_with_log_tail(tmp_path):
    port = free_port()
    r = start_sh("--port", str(port), "--model", str(tmp_path / "no-such-model"), "--log", str(tmp_path / "s.log"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exited" in r.stderr and "no-such-model" in r.stderr, r.stderr  # the log tail names the cause
    assert not os.path.exists(os.path.join(ROOT, "logs", f"server-{port}.pid"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_default_model_without_gpu_names_the_cpu_preset():
    r = start_sh("--port", str(free_port()), timeout=60)
    assert r.returncode == 2 and "--model tiny" in r.stderr, r.stderr


def test_stop_without_server():
    r = start_sh("--stop", "--port", str(free_port()), timeout=60)
    assert r.returncode == 0 and "no server running" in r.stdout, r.stdout + r.stderr


def test_health_is_503_until_the_engine_is_ready():
    import server
    from qwen35.tokenizer import load_tokenizer

    class Loading:  # the one AsyncEngine attribute /health reads
        ready = False

    async def probe() -> list[int]:
        app = server.build_app(Loading(), load_tokenizer(None), "m", 4096)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            return [(await http.get(path)).status_code for path in ("/health", "/ping")]

    assert asyncio.run(probe()) == [503, 503]
