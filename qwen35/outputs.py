"""Per-request output handling (rank 0): incremental detokenization, stop tokens, stop strings, max_tokens, and the
result types handed to callers.

Streamed text never contains a prefix of a stop string that a later token could complete: the last
len(longest stop string) - 1 characters are held back until the request finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qwen35.sampling_params import SamplingParams
from qwen35.tokenizer import IncrementalDetokenizer


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), as streamed to the server."""
    request_id: str
    text: str                    # new text since the previous output
    token_ids: list[int]         # new token ids since the previous output (a stop token included, its text not)
    finished: bool
    finish_reason: str | None    # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_completion_tokens: int   # all tokens generated so far, a final stop token included
    error: str | None = None     # why, when finish_reason is "error"


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


class OutputState:
    """Tracks one request's generated tokens and text; decides when it stops."""

    def __init__(self, request_id: str, tokenizer, params: SamplingParams, eos_token_ids: list[int],
                 prompt_ids: list[int]):
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_ids)
        ids = eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        # ignore_eos disables stop tokens only (benchmarks fix output lengths); stop strings still apply
        self.stop_token_ids: tuple[int, ...] = () if params.ignore_eos else tuple(dict.fromkeys(ids))
        self.stop_strings = params.stop
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.text = ""
        self.token_ids: list[int] = []
        self._checked = 0       # text length already searched for stop strings
        self._sent_chars = 0
        self._sent_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def suppressed_ids(self) -> tuple[int, ...]:
        """Token ids the sampler must not pick now: stop tokens until min_tokens completion tokens exist."""
        return self.stop_token_ids if len(self.token_ids) < self.params.min_tokens else ()

    def append(self, token_id: int) -> None:
        """Add one sampled token; sets finish_reason when the request is done."""
        assert not self.finished
        self.token_ids.append(token_id)
        n = len(self.token_ids)
        if token_id in self.stop_token_ids and n > self.params.min_tokens:
            self._finish("stop")
            return
        self.text += self._detok.add(token_id)
        if self.stop_strings and n >= self.params.min_tokens and self._cut_at_stop_string():
            self.finish_reason = "stop"
            return
        self._checked = len(self.text)
        if n >= self.params.max_tokens:
            self._finish("length")

    def _cut_at_stop_string(self) -> bool:
        # a new match must end in text added since the last check, so it starts at most _hold chars before it
        start = max(0, self._checked - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def _finish(self, reason: str) -> None:
        # an unfinished UTF-8 character at the end renders as U+FFFD, as a full decode() shows it
        self.text += self._detok.flush()
        self.finish_reason = reason

    def abort(self) -> None:
        self.finish_reason = "abort"

    def fail(self, error: Exception) -> None:
        """End the request with an error of its own; the text already sent stands, held-back text is dropped."""
        self.text = self.text[:self._sent_chars]
        self.finish_reason, self.error = "error", f"{type(error).__name__}: {error}"

    def take_output(self) -> RequestOutput:
        """The delta since the previous call."""
        end = len(self.text) if self.finished else max(self._sent_chars, len(self.text) - self._hold)
        text, self._sent_chars = self.text[self._sent_chars:end], end
        ids, self._sent_tokens = self.token_ids[self._sent_tokens:], len(self.token_ids)
        return RequestOutput(self.request_id, text, ids, self.finished, self.finish_reason,
                             self.num_prompt_tokens, len(self.token_ids), self.error)
