"""Result types handed to callers: RequestOutput (one step's delta of a request, streamed; it lives with the request
record in scheduler/request.py), and the offline API's whole CompletionOutput with its Usage."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import RequestOutput

__all__ = ["CompletionOutput", "RequestOutput", "Usage"]


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
