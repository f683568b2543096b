"""What the HTTP clients in benchmarks/ share: server flags, the async client, client-side token counting, and a
closed-loop runner that keeps exactly `concurrency` requests in flight."""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import time
from dataclasses import dataclass, field

import httpx

from qwen35.tokenizer import load_tokenizer


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key", default=os.environ.get("QWEN35_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $QWEN35_API_KEY)")
    p.add_argument("--model", default=None, help="'model' field of the payloads (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="model directory whose tokenizer counts tokens client-side (default: the built-in Qwen3.5 one)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per HTTP request")


def client(args, concurrency: int = 64) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout, limits=limits)


async def server_models(http: httpx.AsyncClient) -> list[dict]:
    """GET /v1/models: the first request of every client, so an unreachable server or a missing key ends the run
    with a one-line message instead of a traceback."""
    try:
        r = await http.get("/v1/models")
    except httpx.TransportError as e:
        raise SystemExit(f"cannot reach the server at {http.base_url}: {type(e).__name__}: {e}")
    if r.status_code == 401:
        raise SystemExit(f"{http.base_url} requires an API key: pass --api-key KEY or set QWEN35_API_KEY"
                         + (" (the key sent was refused)" if "authorization" in http.headers else ""))
    try:
        r.raise_for_status()
        return r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"GET {http.base_url}/v1/models failed: HTTP {r.status_code}: {r.text[:200]}") from e


async def server_counters(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's /metrics gauges (qwen35_ prefix dropped); empty if it has none to give."""
    try:
        r = await http.get("/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("qwen35_"):
            try:
                out[name[len("qwen35_"):]] = float(value)
            except ValueError:
                pass
    return out


async def served_model(http: httpx.AsyncClient, requested: str | None) -> str:
    models = await server_models(http)  # also when a model is named: it checks the server and the key first
    return requested or models[0]["id"]


@functools.lru_cache(maxsize=None)
def _tokenizer(tokenizer_dir: str | None):
    return load_tokenizer(tokenizer_dir)  # about a second; the tests build many Counters


class Counter:
    """Counts tokens the way the contract's clients do: the chat template rendered client-side for the prompt,
    the returned content re-tokenized for the completion."""

    def __init__(self, tokenizer_dir: str | None):
        self.tok = _tokenizer(tokenizer_dir)

    def prompt(self, messages: list[dict], enable_thinking: bool = False) -> int:
        return len(self.tok.encode(self.tok.apply_chat_template(messages, enable_thinking=enable_thinking)))

    def text(self, text: str) -> int:
        return len(self.tok.encode(text))


@dataclass
class Result:
    index: int
    status: int = 0
    body: dict = field(default_factory=dict)
    error: str | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def content(self) -> str:
        return self.body["choices"][0]["message"]["content"] if self.ok else ""


async def post_chat(http: httpx.AsyncClient, index: int, payload: dict) -> Result:
    res, t0 = Result(index), time.perf_counter()
    try:
        r = await http.post("/v1/chat/completions", json=payload)
        res.status = r.status_code
        res.body = r.json()
        if r.status_code != 200:
            res.error = str(res.body.get("error", res.body))
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - t0
    return res


async def closed_loop(http: httpx.AsyncClient, payloads: list[dict], concurrency: int) -> tuple[list[Result], float]:
    """Send every payload keeping exactly `concurrency` in flight until the queue drains; (results, wall seconds)."""
    queue = list(enumerate(payloads))[::-1]
    results: list[Result] = []

    async def worker():
        while queue:
            i, payload = queue.pop()
            results.append(await post_chat(http, i, payload))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(payloads)))))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0
