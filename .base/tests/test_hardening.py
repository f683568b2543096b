"""Hardening (issue 7): no request can kill the server, the event loop never blocks, a hung rank is seen and ends the
job, secrets stay out of logs and `ps`, start/stop keep logs and end streams cleanly. On the tiny CPU model.

The request-level cases (a top_k past 64 bits, stop_token_ids past the vocabulary, temperature 100.5 or 1e-40,
the lowercase bearer scheme, the developer role) are checks of benchmarks/check_server.py, run against the TP=1 and
TP=2 servers by test_server.py; the step loop's per-request failures are tested in test_engine.py, the sampler's
edge values in test_sampler.py.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import server
from test_server import ROOT, answers, free_port, start_sh, start_tiny, stop_tiny

KEY = "sk-hardening-5e3c1f"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, out) for d in [c, *descendants(c)]]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def env_of(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def server_pid(port: int) -> int:
    with open(os.path.join(ROOT, "logs", f"server-{port}.pid")) as f:
        return int(f.read())


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """The tiny model behind ./start.sh --api-key KEY, with a short context so that fuzzed requests stay quick."""
    port, log = free_port(), str(tmp_path_factory.mktemp("keyed") / "server.log")
    url = start_tiny(port, log, "--api-key", KEY, "--max-model-len", "64")
    with httpx.Client(base_url=url, headers=HEADERS, timeout=120) as http:
        yield http, port, log
    stop_tiny(port, log)


def assert_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert error["message"] and {"type", "param", "code"} <= error.keys(), error
    return error


# ---- connections --------------------------------------------------------------------------------------------------
def test_an_idle_connection_stays_open(keyed):
    """A connection idle for longer than uvicorn's default keep-alive (5 s) still takes the next request: a client
    pool sending on a connection the server is closing gets a read error instead of a response."""
    _, port, _ = keyed

    def get_health(sock) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return data
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(4096)
        return head
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        assert get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)
        assert get_health(sock).startswith(b"HTTP/1.1 200")


# ---- secrets ------------------------------------------------------------------------------------------------------

def test_key_stays_out_of_the_log_and_ps(keyed):
    http, port, log = keyed
    assert http.post(CHAT, json={"messages": HI, "max_tokens": 2}).status_code == 200
    text = open(log).read()
    assert KEY not in text and "API key" in text, text[:2000]
    pids = [server_pid(port), *descendants(server_pid(port))]
    assert len(pids) >= 2, pids  # torchrun and rank 0 at least
    for pid in pids:
        assert KEY not in cmdline(pid), (pid, cmdline(pid))


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    from qwen35.serve import API_KEY_ENV, api_key, parse_args

    key_file = tmp_path / "key"
    key_file.write_text(" from-file\n")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    base = ["--model", "tiny"]
    assert api_key(parse_args(base)) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(parse_args(base)) == "from-env"
    assert api_key(parse_args(base + ["--api-key-file", str(key_file)])) == "from-file"
    assert api_key(parse_args(base + ["--api-key", "from-flag"])) == "from-flag"
    key_file.write_text("\n")
    for missing in (key_file, tmp_path / "none"):
        with pytest.raises(SystemExit, match="API key file"):
            api_key(parse_args(base + ["--api-key-file", str(missing)]))


def test_gsm8k_without_the_key_says_so(keyed):
    http, _, _ = keyed
    env = {k: v for k, v in os.environ.items() if k != "QWEN35_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.gsm8k", "--url", str(http.base_url), "--limit", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "requires an API key" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# ---- the event loop never blocks ----------------------------------------------------------------------------------

def test_oversized_body_is_413(keyed):
    http, _, _ = keyed
    big = json.dumps({"prompt": "x" * (server.DEFAULT_MAX_REQUEST_BYTES + 10)}).encode()
    assert_error_body(http.post(CMPL, content=big, headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: refused while reading
        yield big[:1 << 20]
        for i in range(1 << 20, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    assert_error_body(http.post(CMPL, content=chunks()), 413)
    assert http.get("/health").status_code == 200


@pytest.fixture()
def front():
    """server.build_app on uvicorn in a thread, on a free port (no engine behind it: for what is refused before)."""
    import uvicorn

    from qwen35.tokenizer import load_tokenizer

    class NoEngine:
        ready = True

    app = server.build_app(NoEngine(), load_tokenizer(None), "m", 4096)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield uv.config.port
    uv.should_exit = True
    thread.join(10)


def test_oversized_body_gets_its_413_not_a_reset(front):
    """A 20 MB body (the limit is 8 MiB): the client gets the 413 and its error body after sending all of it, also a
    client that reads nothing before its last byte is out and asks for the connection to close (answering first
    and closing reset it under the bytes still in flight); and with no Content-Length (chunks). A body declared
    past the limit by more than the server reads to drop is answered at once (here nothing of it is sent)."""
    port = front
    big = json.dumps({"prompt": "x" * (20 << 20)}).encode()
    url = f"http://127.0.0.1:{port}{CMPL}"
    for headers in ({}, {"Connection": "close"}):
        assert_error_body(httpx.post(url, content=big, headers=headers, timeout=60), 413)
    chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    error = assert_error_body(httpx.post(url, content=chunks, timeout=60), 413)
    assert error["code"] == "request_too_large" and str(server.DEFAULT_MAX_REQUEST_BYTES) in error["message"]

    def raw(head: bytes, body: bytes) -> bytes:  # sends everything, then reads the answer to its end
        with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
            c.sendall(head + body)
            answer = b""
            while chunk := c.recv(1 << 16):
                answer += chunk
            return answer

    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n" % CMPL.encode()
    answer = raw(head + b"Content-Length: %d\r\n\r\n" % len(big), big)
    assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer, answer[:300]
    huge = server.DEFAULT_MAX_REQUEST_BYTES + server.MAX_DISCARD_BYTES + 1
    answer = raw(head + b"Content-Length: %d\r\n\r\n" % huge, b"")
    assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer, answer[:300]


def test_health_answers_while_a_huge_prompt_is_tokenized(keyed):
    http, _, _ = keyed
    prompt = "the quick brown fox jumps over the lazy dog. " * 50_000  # 2.2 MB: seconds to tokenize
    result = {}

    def big_request():
        result["response"] = http.post(CMPL, json={"prompt": prompt, "max_tokens": 1})

    latencies = []
    worker = threading.Thread(target=big_request)
    worker.start()
    with httpx.Client(base_url=http.base_url, timeout=30) as probe:
        while worker.is_alive():
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    worker.join()
    assert_error_body(result["response"], 400)  # far past the context
    assert len(latencies) >= 10, latencies  # the request really took a while
    assert max(latencies) < 1.0, max(latencies)


# ---- no request field can make a 5xx (property-based) -------------------------------------------------------------

EDGES = [0, 1, -1, 2, 4, -2**63, -2**63 - 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**1100, 1e-40, 1e-5, 0.5, 1.0,
         100.5, 1e308, -0.0, "", "hi", "Q:", [], {}, [1], [300000], [248076], [-1], ["a"] * 5, {"type": "text"},
         {"enable_thinking": True}, {"include_usage": True}, True, False, None]
LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=10)
EDGE = st.sampled_from(EDGES)
VALUE = st.one_of(EDGE, st.integers(), st.floats(), JSON)
# the sampler's own fields get numbers at the edges of what they and the vocabulary can hold most of the time
INT_EDGE = st.sampled_from([0, 1, 2, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -2**63, -2**63 - 1, 248076, 248077,
                            300000])
NUMBER = st.one_of(INT_EDGE, st.lists(INT_EDGE, min_size=1, max_size=3), st.sampled_from(
    [1e-40, 1e-6, 0.5, 1.0, 100.0, 100.5, 1e308, 5e-324, -0.0, math.nan, math.inf]), VALUE)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])
                                 | VALUE, "content": st.text(max_size=30) | VALUE})
FIELDS = ["model", "max_tokens", "max_completion_tokens", "top_p", "top_k", "min_tokens", "stop", "stop_token_ids",
          "seed", "ignore_eos", "stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "tools", "functions",
          "tool_choice", "function_call", "response_format", "echo", "suffix", "use_beam_search", "user"]
SAMPLING = ["max_tokens", "min_tokens", "seed", "stop_token_ids", "temperature", "top_k", "top_p"]


def body(**special) -> st.SearchStrategy:
    """A few fields at a time (with many, the first bad one answers for all and the rest go untested), and sampling
    (temperature > 0) half of the time, or top_k, top_p and seeds never reach the sampler."""
    values = {**{f: VALUE for f in FIELDS}, **{f: NUMBER for f in SAMPLING}, **special}
    names = sorted(values) + 3 * SAMPLING  # the sampler's own fields drawn more often: they reach the step loop
    fields = st.lists(st.sampled_from(names), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: values[n] for n in names}))
    return st.tuples(st.sampled_from([0, 0.7]), fields).map(lambda tf: {"temperature": tf[0], **tf[1]})


CHAT_BODY = body(messages=st.lists(MESSAGE, max_size=3) | VALUE, chat_template_kwargs=VALUE)
CMPL_BODY = body(prompt=st.lists(st.integers(-2, 300000) | EDGE, max_size=6) | VALUE)


def fuzz(http: httpx.Client, path: str, base: dict, fields: dict) -> None:
    # json.dumps writes NaN / Infinity for non-finite floats: not JSON, which must be a 400 too
    r = http.post(path, content=json.dumps({**base, **fields}), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (fields, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert_error_body(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and "internal_server_error" not in r.text, (fields, r.text[-300:])
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (fields, r.text[:300])


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@FUZZ
@given(fields=CHAT_BODY)
def test_fuzz_chat_never_5xx(keyed, fields):
    fuzz(keyed[0], CHAT, {"messages": HI, "max_tokens": 2}, fields)


@FUZZ
@given(fields=CMPL_BODY)
def test_fuzz_completions_never_5xx(keyed, fields):
    fuzz(keyed[0], CMPL, {"prompt": "hi", "max_tokens": 2}, fields)


@pytest.fixture(scope="module")
def boundary():
    """The server's validation on its own, with the engine's request limits of the keyed server (max_model_len 64,
    the tokenizer's real tokens, as LLMEngine makes them) and no engine behind them, and a sampler over the real
    vocabulary."""
    from types import SimpleNamespace

    from layers.sampler import Sampler
    from qwen35.tokenizer import load_tokenizer
    from scheduler.request import RequestLimits

    tok = load_tokenizer(None)
    limits = RequestLimits(vocab_size=tok.num_real_tokens, max_model_len=64, num_kv_blocks=512, block_size=16)
    s = server._Server(SimpleNamespace(check_request=limits.check), tok, "m", 64, None,
                       server.DEFAULT_MAX_REQUEST_BYTES)
    return s, Sampler(tok.num_real_tokens, 248320, 1, "cpu"), torch.randn(1, 248320)


def cross_the_boundary(boundary, prepare, base: dict, fields: dict) -> None:
    """Whatever passes validation is safe for the step loop: its sampler row becomes the sampler's tensors, the
    sampler takes them without raising, every stop id is in the vocabulary (an id past the logits is a device-side
    assert on a GPU), and a seed makes a noise key."""
    from layers.sampler import SamplingStep, stream_key

    s, sampler, logits = boundary
    try:
        _, _, params = s._prepare(json.dumps({**base, **fields}).encode(), prepare(s))
    except server.APIError as e:
        assert 400 <= e.status < 500 and e.message
        return
    stop_ids = params.stop_token_ids or s.eos_ids
    assert max(stop_ids) < s.vocab_size, params
    step = SamplingStep(params.greedy, params.top_k > 0, params.top_p < 1,  # what the engine sends
                        [(0, params.sampler_row(), stream_key(params.seed, 0, 0))],
                        [(0, t) for t in stop_ids] if params.min_tokens else [])
    sampler.admit(step)
    out = sampler.sample(logits, torch.zeros(1, dtype=torch.int64), step)
    assert 0 <= int(out[0]) < s.vocab_size


BOUNDARY = settings(max_examples=1000, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])


@BOUNDARY
@given(fields=CHAT_BODY)
def test_fuzz_chat_validation_bounds_what_the_sampler_sees(boundary, fields):
    cross_the_boundary(boundary, lambda s: s._chat_prompt, {"messages": HI, "max_tokens": 2}, fields)


@BOUNDARY
@given(fields=CMPL_BODY)
def test_fuzz_completions_validation_bounds_what_the_sampler_sees(boundary, fields):
    cross_the_boundary(boundary, lambda s: lambda body: (server._completion_prompt(body, s.tokenizer), "prompt"),
                       {"prompt": "hi", "max_tokens": 2}, fields)


def test_alive_after_the_fuzz(keyed):
    http, _, _ = keyed
    assert http.get("/health").status_code == 200
    body = http.post(CHAT, json={"messages": HI, "max_tokens": 3, "min_tokens": 3}).json()
    assert body["usage"]["completion_tokens"] == 3


# ---- errors the engine reports, through the HTTP layer ----------------------------------------------------------

class _FailingEngine:
    """An AsyncEngine stand-in that accepts every request, whose requests produce one output, then fail with
    `error`."""
    ready = True

    def __init__(self, error: Exception):
        self.error = error

    def check_request(self, prompt_ids, params):
        pass

    def generate(self, request_id, prompt_ids, params, stream=True):
        from qwen35.outputs import RequestOutput

        async def outputs():
            yield RequestOutput(request_id, "partial", [1], False, None, len(prompt_ids), 1)
            raise self.error
        return outputs()


@pytest.mark.parametrize("status", [500, 503])
def test_engine_errors_become_openai_errors(status):
    from qwen35.async_engine import GenerationError
    from qwen35.tokenizer import load_tokenizer

    async def main():
        app = server.build_app(_FailingEngine(GenerationError("it broke", status)), load_tokenizer(None), "m", 4096)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            plain = await http.post(CHAT, json={"messages": HI, "max_tokens": 4})
            streamed = await http.post(CHAT, json={"messages": HI, "max_tokens": 4, "stream": True})
        return plain, streamed

    plain, streamed = asyncio.run(main())
    error = assert_error_body(plain, status)
    assert error["message"] == "it broke"
    assert error["type"] == ("service_unavailable" if status == 503 else "internal_server_error")
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == "it broke", events


# ---- liveness: a stalled step loop ends the job -------------------------------------------------------------------

def test_watchdog_fails_requests_and_health_when_a_step_hangs():
    from qwen35.async_engine import AsyncEngine, GenerationError
    from qwen35.engine import EngineArgs, LLMEngine
    from qwen35.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model="tiny", device="cpu", max_model_len=64, max_num_seqs=2))
    release, stalled = threading.Event(), threading.Event()
    step = engine.step
    engine.step = lambda: release.wait() and step()  # a collective that never returns (a frozen rank)
    ae = AsyncEngine(engine, step_timeout_s=0.5, on_stall=stalled.set)

    async def main():
        assert ae.ready
        t0 = time.monotonic()
        with pytest.raises(GenerationError, match="no progress for 0.5 s") as e:
            async for _ in ae.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                pass
        assert e.value.status == 503 and time.monotonic() - t0 < 5
        assert stalled.wait(5) and not ae.ready  # /health: 503 (on_stall runs on the watchdog thread, just after)
        with pytest.raises(GenerationError):
            ae.generate("later", [1, 2, 3], SamplingParams(max_tokens=4))

    try:
        asyncio.run(main())
    finally:
        release.set()
        ae.shutdown()


def test_frozen_worker_rank_ends_the_job(tmp_path):
    """TP=2 over gloo: SIGSTOP the worker rank; within --step-timeout the request in flight fails, /health stops
    saying 200, and torchrun exits non-zero with the reason in the log."""
    port, log_path = free_port(), tmp_path / "job.log"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "qwen35.serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128",
           "--step-timeout", "3"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pids = [job.pid]
    try:
        deadline = time.time() + 300
        while not (answers(port) and httpx.get(url + "/health").status_code == 200):
            assert job.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        pids += descendants(job.pid)
        worker = next(p for p in pids[1:] if env_of(p).get("RANK") == "1" and "qwen35.serve" in cmdline(p))
        os.kill(worker, signal.SIGSTOP)
        t0 = time.time()
        r = httpx.post(url + CHAT, json={"messages": HI, "max_tokens": 8}, timeout=120)
        assert_error_body(r, 503)
        assert "stalled" in r.json()["error"]["message"] and time.time() - t0 < 3 + 10
        try:
            assert httpx.get(url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone: no answer is no false "healthy" either
        rc = job.wait(timeout=120)  # torchrun gives the frozen rank 30 s to go after SIGTERM, then kills it
        assert rc != 0
        text = log_path.read_text()
        assert "engine stalled: a step made no progress for 3 s" in text, text[-3000:]
    finally:
        kill_all(pids)
        job.wait(timeout=30)


# ---- start.sh and qwen35.serve ------------------------------------------------------------------------------------

def test_serve_help_shows_its_real_name():
    r = subprocess.run([sys.executable, "-m", "qwen35.serve", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m qwen35.serve"), r.stdout[:200]
    assert "--step-timeout" in r.stdout and "--max-request-bytes" in r.stdout and "--api-key-file" in r.stdout


def test_a_restart_keeps_the_earlier_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("Traceback: the crash being investigated\n")
    r = start_sh("--port", str(free_port()), "--model", str(tmp_path / "no-such-model"), "--log", str(log))
    assert r.returncode == 1, r.stdout + r.stderr
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("server.log.")]
    assert len(kept) == 1 and "the crash being investigated" in kept[0].read_text(), list(tmp_path.iterdir())
    assert "no-such-model" in log.read_text()


def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    with socket.socket() as held:  # a listener that is not HTTP: it never answers
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.time()
        r = start_sh("--port", str(port), "--model", "tiny", "--log", str(tmp_path / "s.log"), timeout=120)
        assert r.returncode == 1 and "already in use" in r.stderr, r.stdout + r.stderr
        assert time.time() - t0 < 30 and not os.path.exists(os.path.join(ROOT, "logs", f"server-{port}.pid"))
        # launched without start.sh, the server itself takes its port first
        r = subprocess.run([sys.executable, "-m", "qwen35.serve", "--model", "tiny", "--port", str(port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "cannot listen" in r.stderr and "loading" not in r.stderr, r.stderr[-2000:]


def test_stop_ends_streams_with_an_error_event_and_done(tmp_path):
    port, log = free_port(), str(tmp_path / "server.log")
    url = start_tiny(port, log, "--max-model-len", "4096")
    lines, ended = [], threading.Event()
    payload = {"messages": HI, "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def consume():
        try:
            with httpx.stream("POST", url + CHAT, json=payload, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:  # a cut stream
            lines.append(f"cut: {e!r}")
        ended.set()

    threading.Thread(target=consume, daemon=True).start()
    deadline = time.time() + 60
    while sum(line.startswith("data: ") for line in lines) < 4:
        assert time.time() < deadline and not ended.is_set(), lines
        time.sleep(0.05)
    t0 = time.time()
    stop_tiny(port, log)
    assert ended.wait(10)
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", lines[-3:]
    error = json.loads(data[-2])["error"]
    assert "shutting down" in error["message"] and error["type"] == "service_unavailable", error
    assert time.time() - t0 < 5 + 5, "the stream waited for the graceful-shutdown timeout"
    assert "timeout graceful shutdown exceeded" not in open(log).read()
