"""OpenAI-compatible HTTP front end of the qwen35 engine (starlette + uvicorn + orjson).

`build_app(async_engine, tokenizer, model_name, max_model_len, api_key=None)` returns the ASGI app; `qwen35.serve`
builds the engine and runs it. Routes: GET /health, /ping, /v1/models, /metrics; POST /v1/chat/completions,
/v1/completions, /invocations (= chat completions).

Every request is validated here, before the engine sees it, so bad input is an HTTP 400 with an OpenAI error body
and never an engine error. Policy on request fields:
- honoured: model (any string; responses name the served model), messages (system/user/assistant; content a string
  or a list of {"type": "text"} parts; other keys ignored), prompt (completions: a string or a list of token ids, or
  a one-element list of either), max_tokens / max_completion_tokens (default: all the room left in the context),
  temperature (default 0), top_p (default 1), top_k (0 or -1 = off), min_tokens, stop (string or list of up to 4),
  stop_token_ids (added to the EOS ids), seed, ignore_eos, stream, stream_options.include_usage,
  chat_template_kwargs.enable_thinking (default False).
- refused with a 400 unless at their neutral value: n, best_of, logprobs, top_logprobs, presence/frequency/repetition
  penalties, logit_bias, tools/functions and tool_choice/function_call, response_format other than text, echo,
  suffix, use_beam_search. We cannot honour them, and silently ignoring them would return wrong answers.
- any other key is ignored (clients send `user`, `metadata`, ...), as OpenAI-compatible servers commonly do.
A client that disconnects (streaming or not) has its request aborted at once, freeing its KV blocks and state slot.
With an api_key, /v1/* and /invocations need `Authorization: Bearer <key>` (else 401); /health, /ping and /metrics
stay open for probes and scrapers. Without one, the header is ignored.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import re
import time
import uuid

import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from qwen35.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
SEED_RANGE = (-2**63, 2**63)


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


class APIError(Exception):
    """A client error, rendered as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# Options whose non-neutral values we cannot honour, with the values that are neutral ("auto" tool choice without
# tools is "none").
_NEUTRAL = {
    "n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "echo": (False,), "suffix": ("",), "use_beam_search": (False,),
}
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def _same(value, neutral) -> bool:
    # True == 1 in Python; a boolean where a number is expected (or the reverse) is not the neutral value
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _field(body: dict, name: str, types: tuple, default=None):
    """body[name] checked against `types` (JSON null = absent); int is accepted where float is."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise APIError(f"'{name}' must be {' or '.join(_TYPE_NAMES[t] for t in types)}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = float(_field(body, name, (int, float), default))
    if not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number", param=name)
    return value


def _sampling_params(body: dict, prompt_len: int, max_model_len: int, eos_ids: list[int],
                     prompt_param: str) -> SamplingParams:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise APIError(f"'{name}' is not supported by this server (only {' or '.join(map(repr, neutral))})",
                           param=name)
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(f"the prompt is {prompt_len} tokens, but this model's maximum context length is "
                       f"{max_model_len} tokens", param=prompt_param, code="context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, name, (int,), room)
    if max_tokens < 1:
        raise APIError(f"'{name}' must be at least 1, got {max_tokens}", param=name)
    if max_tokens > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; the request asks for "
                       f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
                       param=name, code="context_length_exceeded")
    temperature = _number(body, "temperature", 0.0)
    if temperature < 0:
        raise APIError("'temperature' must be >= 0", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError("'top_p' must be in (0, 1]", param="top_p")
    top_k = _field(body, "top_k", (int,), 0)
    if top_k < -1:
        raise APIError("'top_k' must be >= 1, or 0 / -1 for no top-k", param="top_k")
    min_tokens = _field(body, "min_tokens", (int,), 0)
    if not 0 <= min_tokens <= max_tokens:
        raise APIError(f"'min_tokens' must be in [0, max_tokens={max_tokens}]", param="min_tokens")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                       param="stop")
    extra_stop_ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in extra_stop_ids):
        raise APIError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    seed = _field(body, "seed", (int,), None)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise APIError("'seed' must fit in a signed 64-bit integer", param="seed")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0), max_tokens=max_tokens, min_tokens=min_tokens,
        stop=stop, stop_token_ids=sorted(set(eos_ids) | set(extra_stop_ids)) if extra_stop_ids else None,
        ignore_eos=_field(body, "ignore_eos", (bool,), False), seed=seed)


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty array of messages", param="messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(f"{param} must be an object", param=param)
        role, content = msg.get("role"), msg.get("content")
        if role not in ("system", "user", "assistant"):
            raise APIError(f"{param}.role must be 'system', 'user' or 'assistant', got {role!r}",
                           param=f"{param}.role")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"{param}.content: only parts of type 'text' with a string 'text' are supported",
                               param=f"{param}.content")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.num_real_tokens
                    for t in prompt)):
        return prompt
    raise APIError("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)",
                   param="prompt")


class _Disconnected(Exception):
    pass


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (which aborts its engine request) if the client goes away first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if work.cancelled():
        raise _Disconnected()
    return work.result()


class _Server:
    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, api_key: str | None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.api_key = max_model_len, api_key
        self.eos_ids = list(tokenizer.eos_token_ids)
        self.created = int(time.time())

    # ---- plain endpoints
    async def health(self, request: Request) -> Response:
        ready = bool(self.engine.ready)
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "qwen35",
            "max_model_len": self.max_model_len}]})

    async def metrics(self, request: Request) -> Response:
        lines = []
        for key, value in self.engine.stats().items():
            if isinstance(value, (int, float)):
                name = "qwen35_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                lines += [f"# TYPE {name} gauge", f"{name} {value:g}" if isinstance(value, float) else
                          f"{name} {int(value)}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ---- generation endpoints
    async def chat(self, request: Request) -> Response:
        self._check_auth(request)
        body = await self._json(request)
        messages = _chat_messages(body)
        kwargs = _field(body, "chat_template_kwargs", (dict,), {})
        thinking = _field(kwargs, "enable_thinking", (bool,), False)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        except Exception as e:  # the template rejects some conversations (e.g. a system message not first)
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from e
        prompt_ids = self.tokenizer.encode(text)
        params = _sampling_params(body, len(prompt_ids), self.max_model_len, self.eos_ids, "messages")
        return await self._generate(request, body, "chatcmpl", prompt_ids, params)

    async def completions(self, request: Request) -> Response:
        self._check_auth(request)
        body = await self._json(request)
        prompt_ids = _completion_prompt(body, self.tokenizer)
        params = _sampling_params(body, len(prompt_ids), self.max_model_len, self.eos_ids, "prompt")
        return await self._generate(request, body, "cmpl", prompt_ids, params)

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                           code="invalid_api_key")

    @staticmethod
    async def _json(request: Request) -> dict:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise APIError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        return body

    async def _generate(self, request: Request, body: dict, kind: str, prompt_ids: list[int],
                        params: SamplingParams) -> Response:
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        include_usage = _field(options, "include_usage", (bool,), False)
        rid = f"{kind}-{uuid.uuid4().hex}"
        try:
            outputs = self.engine.generate(rid, prompt_ids, params)
        except ValueError as e:  # what only the engine can tell, e.g. a request bigger than the whole KV cache
            raise APIError(str(e)) from e
        except RuntimeError as e:  # the engine is not running (yet, or any more)
            raise APIError(str(e), status=503, type_="service_unavailable") from e
        if stream:
            events = self._sse(rid, kind, outputs, include_usage)
            # starlette stops iterating on a disconnect without closing the iterator: close it, and so abort
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(events.aclose))
        try:
            text, finish, usage = await _unless_disconnected(request, self._collect(outputs))
        except _Disconnected:
            return Response(status_code=499)  # nobody is listening; the request is aborted
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish} if kind == "chatcmpl" else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chatcmpl" else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": [choice],
                             "usage": usage})

    @staticmethod
    def _usage(out) -> dict:
        return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_completion_tokens,
                "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}

    async def _collect(self, outputs):
        parts = []
        async for out in outputs:  # cancelling this (a disconnect) aborts the request
            parts.append(out.text)
        return "".join(parts), out.finish_reason, self._usage(out)

    async def _sse(self, rid: str, kind: str, outputs, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chatcmpl" else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if kind == "chatcmpl":
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            data = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return b"data: " + orjson.dumps(data) + b"\n\n"

        try:
            if kind == "chatcmpl":
                yield chunk(None, None, role=True)
            async for out in outputs:
                if out.text or out.finished:
                    yield chunk(out.text, out.finish_reason)
            if include_usage:
                data = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                        "usage": self._usage(out)}
                yield b"data: " + orjson.dumps(data) + b"\n\n"
        except Exception as e:  # headers are gone already: report in-band, as OpenAI does
            err = {"error": {"message": f"generation failed: {e}", "type": "internal_server_error",
                             "param": None, "code": None}}
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        finally:
            await outputs.aclose()
        yield b"data: [DONE]\n\n"


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(str(exc.detail), status=exc.status_code).response()


def build_app(async_engine, tokenizer, model_name: str, max_model_len: int, api_key: str | None = None) -> Starlette:
    s = _Server(async_engine, tokenizer, model_name, max_model_len, api_key)
    routes = [
        Route("/health", s.health, methods=["GET"]),
        Route("/ping", s.health, methods=["GET"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/metrics", s.metrics, methods=["GET"]),
        Route("/v1/chat/completions", s.chat, methods=["POST"]),
        Route("/invocations", s.chat, methods=["POST"]),
        Route("/v1/completions", s.completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={APIError: _api_error, HTTPException: _http_error})
