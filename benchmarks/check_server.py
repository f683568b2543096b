"""API conformance checks against a running qwen35 server (serving contract section 2).

    python -m benchmarks.check_server --url http://127.0.0.1:8000 [--api-key KEY] [--only a,b] [--concurrency 64]

Prints PASS/FAIL per check and exits 1 when any fails. The checks hold for any weights, synthetic ones included:
they compare the server with itself (greedy output streamed and not, a stop string cut from its own output)
instead of expecting particular text. `disconnect` reads the server's own /metrics (qwen35_num_running).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import httpx
import orjson

from benchmarks.common import Counter, add_server_args, client, server_models

CHECKS: dict[str, object] = {}
FIRST_REQUEST_LIMIT_S = 120.0  # the contract's limit on the first request after start
HELLO = [{"role": "user", "content": "Hello! Tell me about the sea."}]


def check(fn):
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@dataclass
class Ctx:
    http: httpx.AsyncClient
    counter: Counter
    model: str
    max_model_len: int
    api_key: str | None
    concurrency: int
    usage_tolerance: float

    async def post(self, path: str, payload: dict, **kw) -> httpx.Response:
        return await self.http.post(path, json={"model": self.model, **payload}, **kw)

    async def chat(self, **payload) -> dict:
        return ok_json(await self.post("/v1/chat/completions", payload))

    async def stream(self, path: str, **payload) -> tuple[httpx.Headers, list[dict]]:
        """The SSE events of a streamed request, checking that [DONE] ends them."""
        events, done = [], False
        async with self.http.stream("POST", path, json={"model": self.model, "stream": True, **payload}) as r:
            assert r.status_code == 200, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                assert not done, "data after [DONE]"
                if line == "data: [DONE]":
                    done = True
                else:
                    events.append(orjson.loads(line[6:]))
        assert done, "the stream did not end with data: [DONE]"
        return r.headers, events

    async def metrics(self, *names: str) -> tuple[float, ...]:
        """The values of `names` from one read of /metrics (each name's line "name value")."""
        text = (await self.http.get("/metrics")).text
        values = dict(line.split()[:2] for line in text.splitlines() if line and not line.startswith("#"))
        missing = [name for name in names if name not in values]
        assert not missing, f"/metrics has no {', '.join(missing)}"
        return tuple(float(values[name]) for name in names)

    async def metric(self, name: str) -> float:
        return (await self.metrics(name))[0]


def ok_json(r: httpx.Response) -> dict:
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    return r.json()


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def check_usage(usage: dict, prompt_tokens: int | None = None) -> None:
    assert all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")), usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    if prompt_tokens is not None:
        assert usage["prompt_tokens"] == prompt_tokens, f"usage {usage}, but the client counts {prompt_tokens} prompt"


def check_chat_shape(body: dict, ctx: Ctx) -> None:
    assert isinstance(body["id"], str) and body["id"], body
    assert body["object"] == "chat.completion" and isinstance(body["created"], int), body
    assert body["model"] == ctx.model, body["model"]
    choice = body["choices"][0]
    assert len(body["choices"]) == 1 and choice["index"] == 0, body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), choice
    assert choice["finish_reason"] in ("stop", "length"), choice
    assert "<think>" not in choice["message"]["content"], "thinking text with thinking off"


@check
async def check_health(ctx: Ctx) -> None:
    for path in ("/health", "/ping"):
        r = await ctx.http.get(path)
        assert r.status_code == 200, f"{path}: HTTP {r.status_code}"


@check
async def check_models(ctx: Ctx) -> None:
    body = ok_json(await ctx.http.get("/v1/models"))
    assert body["object"] == "list" and body["data"][0]["object"] == "model", body
    assert ctx.model in [m["id"] for m in body["data"]], body


@check
async def check_chat(ctx: Ctx) -> None:
    t0 = time.perf_counter()
    body = await ctx.chat(messages=HELLO, max_tokens=16)
    elapsed = time.perf_counter() - t0
    assert elapsed < FIRST_REQUEST_LIMIT_S, f"took {elapsed:.0f} s"
    check_chat_shape(body, ctx)
    check_usage(body["usage"], ctx.counter.prompt(HELLO))
    assert 1 <= body["usage"]["completion_tokens"] <= 16, body["usage"]


@check
async def check_usage_counts(ctx: Ctx) -> None:
    for field, n in (("max_tokens", 24), ("max_completion_tokens", 9)):
        body = await ctx.chat(messages=HELLO, ignore_eos=True, **{field: n})
        check_usage(body["usage"], ctx.counter.prompt(HELLO))
        assert body["choices"][0]["finish_reason"] == "length", body["choices"]
        assert body["usage"]["completion_tokens"] == n, f"{field}={n} but usage {body['usage']}"
        recount = ctx.counter.text(content(body))
        assert abs(recount - n) <= max(2, ctx.usage_tolerance * n), f"content re-tokenizes to {recount}, usage {n}"


@check
async def check_stream(ctx: Ctx) -> None:
    payload = {"messages": HELLO, "max_tokens": 20, "temperature": 0}
    whole = await ctx.chat(**payload)
    headers, events = await ctx.stream("/v1/chat/completions", stream_options={"include_usage": True}, **payload)
    assert headers["content-type"].startswith("text/event-stream"), headers["content-type"]
    assert len({e["id"] for e in events}) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"].get("role") == "assistant", events[0]
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == whole["usage"], f"{usage} vs {whole['usage']}"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert text == content(whole), f"streamed {text!r} but not streamed {content(whole)!r}"
    finish = [e["choices"][0]["finish_reason"] for e in chunks]
    assert finish[-1] == whole["choices"][0]["finish_reason"] and not any(finish[:-1]), finish
    _, events = await ctx.stream("/v1/chat/completions", **payload)
    assert all(e["choices"] and e.get("usage") is None for e in events), "usage sent without include_usage"


@check
async def check_completions(ctx: Ctx) -> None:
    prompt = "The capital of France is"
    body = ok_json(await ctx.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}))
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str), body
    assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    check_usage(body["usage"], ctx.counter.text(prompt))
    ids = ctx.counter.tok.encode(prompt)
    same = ok_json(await ctx.post("/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0}))
    check_usage(same["usage"], len(ids))
    assert same["choices"][0]["text"] == body["choices"][0]["text"], "token-id prompt and text prompt differ"
    _, events = await ctx.stream("/v1/completions", prompt=prompt, max_tokens=8, temperature=0)
    assert all(e["object"] == "text_completion" for e in events), events[0]
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]


@check
async def check_stop_strings(ctx: Ctx) -> None:
    base = {"messages": HELLO, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = content(await ctx.chat(**base))
    assert len(text) >= 8, f"output too short to cut a stop string from: {text!r}"
    stop = text[len(text) // 2:len(text) // 2 + 3]
    expected = text[:text.find(stop)]
    for value in ([stop, "\x00never"], stop):
        body = await ctx.chat(**base, stop=value)
        assert content(body) == expected and body["choices"][0]["finish_reason"] == "stop", \
            f"stop={value!r}: got {content(body)!r} ({body['choices'][0]['finish_reason']}), expected {expected!r}"
    _, events = await ctx.stream("/v1/chat/completions", **base, stop=[stop])
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == expected, f"streamed {streamed!r}, expected {expected!r}"


@check
async def check_integer_temperature(ctx: Ctx) -> None:
    a = await ctx.chat(messages=HELLO, max_tokens=12, temperature=0)
    b = await ctx.chat(messages=HELLO, max_tokens=12, temperature=0.0)
    assert content(a) == content(b), "temperature 0 and 0.0 differ"


@check
async def check_message_forms(ctx: Ctx) -> None:
    text = HELLO[0]["content"]
    plain = await ctx.chat(messages=HELLO, max_tokens=8)
    forms = ([{"role": "user", "content": [{"type": "text", "text": text}]}],
             [{"role": "user", "content": text, "type": "text", "name": "someone"}])
    for messages in forms:
        body = await ctx.chat(messages=messages, max_tokens=8)
        assert body["usage"] == plain["usage"] and content(body) == content(plain), f"{messages} differs from a string"
    # newer OpenAI clients send the system prompt as role "developer"
    system = await ctx.chat(messages=[{"role": "system", "content": "Be brief."}, *HELLO], max_tokens=8)
    developer = await ctx.chat(messages=[{"role": "developer", "content": "Be brief."}, *HELLO], max_tokens=8)
    assert developer["usage"] == system["usage"] and content(developer) == content(system), "developer != system"


@check
async def check_extreme_values(ctx: Ctx) -> None:
    """Valid values at the edges of their types are served, and the server stays up: a top_k past 64 bits (the
    whole vocabulary), a temperature too small to divide by (greedy), stop_token_ids at the end of the vocabulary."""
    greedy = content(await ctx.chat(messages=HELLO, max_tokens=12, temperature=0))
    for temperature in (1e-40, 1e-7):
        tiny = content(await ctx.chat(messages=HELLO, max_tokens=12, temperature=temperature))
        assert tiny == greedy, f"temperature {temperature}: {tiny!r}, greedy {greedy!r}"
    for top_k in (2**63, 2**64 - 1):  # larger integer literals are floats to the JSON parser (a 400)
        await ctx.chat(messages=HELLO, max_tokens=4, temperature=1.0, top_k=top_k)
    last = ctx.counter.tok.num_real_tokens - 1
    await ctx.chat(messages=HELLO, max_tokens=4, min_tokens=2, stop_token_ids=[last], temperature=1.0)
    assert (await ctx.http.get("/health")).status_code == 200, "unhealthy after the extreme values"


@check
async def check_seed(ctx: Ctx) -> None:
    payload = {"messages": HELLO, "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234}
    a, b = await ctx.chat(**payload), await ctx.chat(**payload)
    assert content(a) == content(b), "the same seed gave different outputs"


@check
async def check_thinking_toggle(ctx: Ctx) -> None:
    body = await ctx.chat(messages=HELLO, max_tokens=4, chat_template_kwargs={"enable_thinking": True})
    check_usage(body["usage"], ctx.counter.prompt(HELLO, enable_thinking=True))


@check
async def check_invocations(ctx: Ctx) -> None:
    body = ok_json(await ctx.post("/invocations", {"messages": HELLO, "max_tokens": 4}))
    check_chat_shape(body, ctx)


@check
async def check_metrics(ctx: Ctx) -> None:
    r = await ctx.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.status_code
    await ctx.metrics(*("qwen35_" + name for name in (
        "num_running", "num_waiting", "total_prompt_tokens", "total_completion_tokens", "last_step_time_s",
        "kv_blocks_used", "kv_blocks_total", "state_slots_used", "state_slots_total")))


def bad_requests(ctx: Ctx) -> list[tuple[str, str, object]]:
    """(what, path, JSON body or raw bytes): each must get a 400."""
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    ok = {"model": ctx.model, "messages": HELLO}
    long_text = "hello " * (ctx.max_model_len + 8)
    return [
        ("malformed JSON", chat, b'{"messages": ['), ("body not an object", chat, [1, 2]),
        ("no messages", chat, {"model": ctx.model}), ("empty messages", chat, {**ok, "messages": []}),
        ("messages not a list", chat, {**ok, "messages": "hi"}),
        ("message not an object", chat, {**ok, "messages": ["hi"]}),
        ("unknown role", chat, {**ok, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("missing content", chat, {**ok, "messages": [{"role": "user"}]}),
        ("content a number", chat, {**ok, "messages": [{"role": "user", "content": 42}]}),
        ("image content part", chat, {**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("max_tokens 0", chat, {**ok, "max_tokens": 0}), ("max_tokens -5", chat, {**ok, "max_tokens": -5}),
        ("max_tokens a string", chat, {**ok, "max_tokens": "ten"}), ("max_tokens 2.5", chat, {**ok, "max_tokens": 2.5}),
        ("max_tokens past the context", chat, {**ok, "max_tokens": ctx.max_model_len}),
        ("prompt longer than the context", chat, {**ok, "messages": [{"role": "user", "content": long_text}]}),
        ("temperature -1", chat, {**ok, "temperature": -1}),
        ("temperature 100.5", chat, {**ok, "temperature": 100.5}),
        ("temperature past float range", chat, {**ok, "temperature": 2**1100}),
        ("temperature NaN", chat, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        ("temperature a string", chat, {**ok, "temperature": "hot"}),
        ("top_p 0", chat, {**ok, "top_p": 0}), ("top_p 1.5", chat, {**ok, "top_p": 1.5}),
        ("n 2", chat, {**ok, "n": 2}), ("logprobs", chat, {**ok, "logprobs": True}),
        ("presence_penalty", chat, {**ok, "presence_penalty": 0.5}),
        ("tools", chat, {**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("5 stop strings", chat, {**ok, "stop": ["a", "b", "c", "d", "e"]}),
        ("stop a number", chat, {**ok, "stop": 12}),
        ("seed a string", chat, {**ok, "seed": "abc"}), ("seed past 64 bits", chat, {**ok, "seed": 2**64}),
        ("stream a string", chat, {**ok, "stream": "yes"}),
        ("stop_token_ids past the vocabulary", chat, {**ok, "stop_token_ids": [300000], "min_tokens": 2}),
        ("stop_token_ids past 64 bits", chat, {**ok, "stop_token_ids": [2**64], "min_tokens": 2}),
        ("top_k -2", chat, {**ok, "top_k": -2}),
        ("min_tokens past max_tokens", chat, {**ok, "max_tokens": 2, "min_tokens": 3}),
        ("no prompt", cmpl, {"model": ctx.model}), ("empty prompt", cmpl, {"model": ctx.model, "prompt": ""}),
        ("negative token id", cmpl, {"model": ctx.model, "prompt": [1, -1]}),
        ("completion prompt too long", cmpl, {"model": ctx.model, "prompt": long_text}),
    ]


@check
async def check_bad_requests(ctx: Ctx) -> None:
    failures = []
    for what, path, body in bad_requests(ctx):
        r = await (ctx.http.post(path, content=body) if isinstance(body, bytes) else ctx.http.post(path, json=body))
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 400 or error.get("type") != "invalid_request_error" or not error.get("message") \
                or not {"param", "code"} <= error.keys():
            failures.append(f"{what}: HTTP {r.status_code} {r.text[:120]}")
    assert not failures, "; ".join(failures)
    assert (await ctx.http.get("/health")).status_code == 200, "unhealthy after the bad requests"
    check_usage((await ctx.chat(messages=HELLO, max_tokens=4))["usage"])


@check
async def check_auth(ctx: Ctx) -> None:
    async with httpx.AsyncClient(base_url=ctx.http.base_url, timeout=60) as bare:
        payload = {"model": ctx.model, "messages": HELLO, "max_tokens": 2}
        if ctx.api_key is None:  # a stray key must be ignored
            r = await bare.post("/v1/chat/completions", json=payload, headers={"Authorization": "Bearer whatever"})
            assert r.status_code == 200, f"HTTP {r.status_code} with an unconfigured key"
            return
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ctx.api_key},
                        {"Authorization": f"Basic {ctx.api_key}"}):
            r = await bare.post("/v1/chat/completions", json=payload, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["message"], f"{headers}: HTTP {r.status_code}"
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
            r = await bare.post("/v1/chat/completions", json=payload,
                                headers={"Authorization": f"{scheme} {ctx.api_key}"})
            assert r.status_code == 200, f"'{scheme} KEY': HTTP {r.status_code}"
        assert (await bare.get("/health")).status_code == 200, "/health must not need the key"


async def wait_load(ctx: Ctx, running: int, waiting: int, when: str, timeout: float) -> None:
    """Wait until /metrics counts `running` and `waiting` requests; fails after `timeout` seconds. (/metrics is a
    snapshot the engine takes between steps, so it may lag what a client has read by a step.)"""
    t0 = time.perf_counter()
    while (load := await ctx.metrics("qwen35_num_running", "qwen35_num_waiting")) != (running, waiting):
        assert time.perf_counter() - t0 < timeout, \
            f"{when}: (running, waiting) {load} after {timeout} s, not {(running, waiting)}"
        await asyncio.sleep(0.05)


async def wait_idle(ctx: Ctx, when: str, timeout: float = 15.0) -> None:
    await wait_load(ctx, 0, 0, when, timeout)


@check
async def check_disconnect(ctx: Ctx) -> None:
    """A client that goes away has its request aborted: the server is idle again long before max_tokens."""
    max_tokens = min(4000, ctx.max_model_len - 64)
    payload = {"model": ctx.model, "messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True}
    await wait_idle(ctx, "before the test")
    before = await ctx.metric("qwen35_total_completion_tokens")
    async with ctx.http.stream("POST", "/v1/chat/completions", json={**payload, "stream": True}) as r:
        tokens = 0
        async for line in r.aiter_lines():  # leaving after a few tokens closes the connection
            if line.startswith("data: "):
                assert line != "data: [DONE]", f"the stream ended after {tokens} tokens of {max_tokens}"
                event = orjson.loads(line[6:])
                assert "choices" in event, f"the streamed request failed: {line[:300]}"
                tokens += bool(event["choices"][0]["delta"].get("content"))
            if tokens == 3:
                break
        await wait_load(ctx, 1, 0, "the streamed request is not running", 5.0)
    await wait_idle(ctx, "after a streaming client left")
    async with httpx.AsyncClient(base_url=ctx.http.base_url, headers=ctx.http.headers, timeout=3.0) as short:
        call = asyncio.ensure_future(short.post("/v1/chat/completions", json=payload))
        while await ctx.metric("qwen35_num_running") < 1:
            assert not call.done(), f"the request ended before it was seen running: {call.result().text[:200]}"
            await asyncio.sleep(0.05)
        try:
            await call
            raise AssertionError(f"{max_tokens} tokens came back within 3 s: too fast to test a disconnect")
        except httpx.ReadTimeout:
            pass  # the client gave up and closed the connection
    await wait_idle(ctx, "after a non-streaming client left")
    generated = await ctx.metric("qwen35_total_completion_tokens") - before
    assert generated < max_tokens, f"{generated} tokens generated for two abandoned requests: not aborted"


@check
async def check_concurrency(ctx: Ctx) -> None:
    async def one(i: int) -> dict:
        messages = [{"role": "user", "content": f"Request {i}: count to ten."}]
        body = await ctx.chat(messages=messages, max_tokens=8 + i % 5, temperature=1.0, seed=i)
        check_usage(body["usage"], ctx.counter.prompt(messages))
        return body

    bodies = await asyncio.gather(*(one(i) for i in range(ctx.concurrency)))
    assert len({b["id"] for b in bodies}) == ctx.concurrency, "duplicate response ids"


async def run_checks(args) -> list[tuple[str, bool, str, float]]:
    """Run the selected checks in order: (name, passed, detail, seconds) each, printed as they finish."""
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = set(names) - set(CHECKS)
    if unknown:
        raise SystemExit(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    results = []
    async with client(args, args.concurrency) as http:
        models = await server_models(http)
        ctx = Ctx(http, Counter(args.tokenizer), args.model or models[0]["id"], models[0]["max_model_len"],
                  args.api_key, args.concurrency, args.usage_tolerance)
        for name in names:
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(CHECKS[name](ctx), args.check_timeout)
                ok, detail = True, ""
            except Exception as e:  # a check's failure (or crash) is reported, and the next check runs
                ok, detail = False, f"{type(e).__name__}: {e}"
            seconds = time.perf_counter() - t0
            results.append((name, ok, detail, seconds))
            print(f"{'PASS' if ok else 'FAIL'} {name} ({seconds:.1f} s){': ' + detail if detail else ''}", flush=True)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(CHECKS)}")
    p.add_argument("--concurrency", type=int, default=64, help="simultaneous requests of the concurrency check")
    p.add_argument("--usage-tolerance", type=float, default=0.15,
                   help="allowed relative gap between usage.completion_tokens and the re-tokenized content")
    p.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    return p.parse_args(argv)


def main(argv=None) -> int:
    results = asyncio.run(run_checks(parse_args(argv)))
    failed = [name for name, ok, _, _ in results if not ok]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
