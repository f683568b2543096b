"""What callers get back: RequestOutput (one step's delta of a request, streamed; it lives with the request record in
scheduler/request.py), the offline API's whole CompletionOutput with its Usage, and GenerationError, which a request's
stream raises when the engine ended it. Light (no torch): the HTTP server (server.py) imports it without the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import RequestOutput

__all__ = ["CompletionOutput", "GenerationError", "RequestOutput", "Usage"]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class CompletionOutput:
    """A whole completion (offline API)."""
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    error: str | None = None     # why, when finish_reason is "error"


class GenerationError(RuntimeError):
    """A request ended by the engine instead of by its own stop condition: its own failure (500), or the engine
    going away under it (shutdown, a stalled step loop: 503). `status` is the HTTP status a server answers with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status
