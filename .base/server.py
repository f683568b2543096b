"""OpenAI-compatible HTTP front end of the qwen35 engine (starlette + uvicorn + orjson).

`build_app(async_engine, tokenizer, model_name, max_model_len, api_key=None, max_request_bytes=8 MiB)` returns the
ASGI app; `qwen35.serve` builds the engine and runs it. Routes: GET /health, /ping, /v1/models, /metrics;
POST /v1/chat/completions, /v1/completions, /invocations (= chat completions).

Every request is validated here, before the engine sees it (the engine trusts what it gets), so bad input is an HTTP
4xx with an OpenAI error body and never an engine error: the fields' JSON types and this server's policy below, then
the one check of their values: SamplingParams as it is made, and the engine's limits (engine.check_request:
RequestLimits, context length, vocabulary, what the KV cache can ever hold); every number is bounded (integers to
what the sampler's tensors hold and to the vocabulary, floats finite and in range). A body past max_request_bytes is
a 413, its rest read and dropped first (up to MAX_DISCARD_BYTES more) so that the client gets the answer; parsing,
template rendering and tokenizing run in worker threads, so a huge prompt never stalls the event loop (/health and
every other client keep their answers). Policy on request fields:
- honoured: model (any string; responses name the served model), messages (system/user/assistant, and developer,
  which is the system role of newer OpenAI clients; content a string or a list of {"type": "text"} parts; other keys
  ignored), prompt (completions: a string or a list of token ids, or
  a one-element list of either), max_tokens / max_completion_tokens (default: all the room left in the context),
  temperature (default 0, at most 100; below 1e-5 greedy), top_p (default 1), top_k (0 or -1 = off; past the
  vocabulary = off), min_tokens, stop (string or list of up to 4), stop_token_ids (up to 1024 ids in the vocabulary;
  added to the EOS ids), seed (64-bit), ignore_eos, stream, stream_options.include_usage,
  chat_template_kwargs.enable_thinking (default False).
- refused with a 400 unless at their neutral value: n, best_of, logprobs, top_logprobs, presence/frequency/repetition
  penalties, logit_bias, tools/functions and tool_choice/function_call, response_format other than text, echo,
  suffix, use_beam_search. We cannot honour them, and silently ignoring them would return wrong answers.
- any other key is ignored (clients send `user`, `metadata`, ...), as OpenAI-compatible servers commonly do.
A client that disconnects (streaming or not) has its request aborted at once, freeing its KV blocks and state slot.
With an api_key, /v1/* and /invocations need `Authorization: Bearer <key>` (the scheme in any case, RFC 7235; else
401); /health, /ping and /metrics stay open for probes and scrapers. Without one, the header is ignored.
A request the engine ends with an error is a 500 (503 while the engine shuts down or has stalled) with an OpenAI
error body; a stream already under way gets the error as a final event, then `data: [DONE]`.
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
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from qwen35.chat_template import ChatTemplateUnavailable
from qwen35.outputs import GenerationError
from scheduler.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 1024  # far more than anyone sends; each is masked out of the logits at every step
# A 32k-token context is about 130 KB of text and 230 KB as a token-id list; 8 MiB leaves room for JSON escapes and
# long conversations while bounding what one request makes us parse and tokenize (seconds, in a worker thread).
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# An oversized body is read to its end (and dropped) before the 413, up to this much past the limit: seconds on a
# slow link at most, and its client then gets the answer instead of a reset connection.
MAX_DISCARD_BYTES = 64 << 20
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}


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
    try:
        value = float(_field(body, name, (int, float), default))
    except OverflowError:  # an integer past float range
        value = math.inf
    if not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number", param=name)
    return value


def _sampling_params(body: dict, prompt_len: int, max_model_len: int, eos_ids: list[int],
                     vocab_size: int) -> SamplingParams:
    """The request's SamplingParams: the body's fields as JSON types, OpenAI's conventions and this server's policy
    (what it refuses, the list sizes) here; their values are checked once, by SamplingParams as it is made and by the
    engine's limits (RequestLimits: context length, vocabulary, KV cache), whose errors _prepare turns into 400s."""
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise APIError(f"'{name}' is not supported by this server (only {' or '.join(map(repr, neutral))})",
                           param=name)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # by default all the room the context leaves (a prompt that leaves none is refused by the limits)
    max_tokens = _field(body, name, (int,), max(max_model_len - prompt_len, 1))
    top_k = _field(body, "top_k", (int,), 0)
    top_k = 0 if top_k == -1 or top_k >= vocab_size else top_k  # -1, or the whole vocabulary: no top-k
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                       param="stop")
    extra_stop_ids = _field(body, "stop_token_ids", (list,), [])
    if len(extra_stop_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in extra_stop_ids):
        raise APIError(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                       param="stop_token_ids")
    return SamplingParams(
        temperature=_number(body, "temperature", 0.0), top_p=_number(body, "top_p", 1.0), top_k=top_k,
        max_tokens=max_tokens, min_tokens=_field(body, "min_tokens", (int,), 0), stop=stop,
        stop_token_ids=sorted(set(eos_ids) | set(extra_stop_ids)) if extra_stop_ids else None,
        ignore_eos=_field(body, "ignore_eos", (bool,), False), seed=_field(body, "seed", (int,), None))


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
        if not isinstance(role, str) or role not in ROLES:
            raise APIError(f"{param}.role must be 'system', 'developer', 'user' or 'assistant', got {role!r}",
                           param=f"{param}.role")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"{param}.content: only parts of type 'text' with a string 'text' are supported",
                               param=f"{param}.content")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"{param}.content must be a string or a list of text parts", param=f"{param}.content")
        out.append({"role": ROLES[role], "content": content})
    return out


def _json_object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # (the ids' range is the engine's limits' to check)
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


def _error_body(e: Exception) -> dict:
    status = e.status if isinstance(e, GenerationError) else 500
    return {"error": {"message": str(e) if isinstance(e, GenerationError) else f"generation failed: {e}",
                      "type": "service_unavailable" if status == 503 else "internal_server_error",
                      "param": None, "code": None}}


class _Server:
    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, api_key: str | None,
                 max_request_bytes: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.api_key, self.max_request_bytes = max_model_len, api_key, max_request_bytes
        self.eos_ids = list(tokenizer.eos_token_ids)
        self.vocab_size = tokenizer.num_real_tokens  # ids past it are no tokens
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
        return await self._serve(request, "chatcmpl", self._chat_prompt)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "cmpl", lambda body: (_completion_prompt(body, self.tokenizer), "prompt"))

    async def _serve(self, request: Request, kind: str, prompt_of) -> Response:
        self._check_auth(request)
        raw = await self._read_body(request)
        # parsing, template rendering and tokenizing take seconds for a big request: in a worker thread, so that the
        # event loop goes on answering everyone else meanwhile
        body, prompt_ids, params = await run_in_threadpool(self._prepare, raw, prompt_of)
        return await self._generate(request, body, kind, prompt_ids, params)

    def _prepare(self, raw: bytes, prompt_of) -> tuple[dict, list[int], SamplingParams]:
        body = _json_object(raw)
        prompt_ids, prompt_param = prompt_of(body)
        try:  # the request's one check: SamplingParams as it is made, then the engine's limits (RequestLimits)
            params = _sampling_params(body, len(prompt_ids), self.max_model_len, self.eos_ids, self.vocab_size)
            self.engine.check_request(prompt_ids, params)
        except ValueError as e:
            field = getattr(e, "field", None)
            param = {"prompt": prompt_param, "max_tokens": "max_completion_tokens"
                     if body.get("max_completion_tokens") is not None else "max_tokens"}.get(field, field)
            raise APIError(str(e), param=param, code=getattr(e, "code", None)) from e
        return body, prompt_ids, params

    def _chat_prompt(self, body: dict) -> tuple[list[int], str]:
        messages = _chat_messages(body)
        kwargs = _field(body, "chat_template_kwargs", (dict,), {})
        thinking = _field(kwargs, "enable_thinking", (bool,), False)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        except ChatTemplateUnavailable as e:  # a model without a renderable chat template: completions only
            raise APIError(str(e), param="messages") from e
        except Exception as e:  # the template rejects some conversations (e.g. a system message not first)
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from e
        return self.tokenizer.encode(text), "messages"

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the auth scheme is case-insensitive (RFC 7235): "bearer" and "BEARER" are Bearer
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                           code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) past max_request_bytes; an oversized body is never buffered whole. Its rest is read
        and dropped before the 413 goes out (up to MAX_DISCARD_BYTES more), so that a client that sends its whole body
        before reading the answer gets it: answering first and closing would reset the connection under the bytes
        still in flight (a client sending `Connection: close` met that). A body declared larger than that is
        answered at once."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + MAX_DISCARD_BYTES:
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > limit + MAX_DISCARD_BYTES:
                break
        if size > limit:
            raise self._too_large()
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than this server's limit of {self.max_request_bytes} bytes",
                        status=413, code="request_too_large")

    async def _generate(self, request: Request, body: dict, kind: str, prompt_ids: list[int],
                        params: SamplingParams) -> Response:
        stream = _field(body, "stream", (bool,), False)
        options = _field(body, "stream_options", (dict,), {})
        include_usage = _field(options, "include_usage", (bool,), False)
        rid = f"{kind}-{uuid.uuid4().hex}"
        try:
            outputs = self.engine.generate(rid, prompt_ids, params, stream=stream)
        except RuntimeError as e:  # the engine is not running (yet, or any more: shutting down, stalled)
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
        except GenerationError as e:  # the engine ended the request: its own failure, a shutdown, a stall
            return JSONResponse(_error_body(e), status_code=e.status)
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
            yield b"data: " + orjson.dumps(_error_body(e)) + b"\n\n"
        finally:
            await outputs.aclose()
        yield b"data: [DONE]\n\n"


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(str(exc.detail), status=exc.status_code).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    # a bug, never the client's doing; still an OpenAI error body (the traceback goes to the log)
    return APIError(f"internal error: {type(exc).__name__}", status=500, type_="internal_server_error").response()


def build_app(async_engine, tokenizer, model_name: str, max_model_len: int, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Starlette:
    s = _Server(async_engine, tokenizer, model_name, max_model_len, api_key, max_request_bytes)
    routes = [
        Route("/health", s.health, methods=["GET"]),
        Route("/ping", s.health, methods=["GET"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/metrics", s.metrics, methods=["GET"]),
        Route("/v1/chat/completions", s.chat, methods=["POST"]),
        Route("/invocations", s.chat, methods=["POST"]),
        Route("/v1/completions", s.completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                                        Exception: _internal_error})
