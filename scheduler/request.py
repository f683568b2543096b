"""The one record of a request, from arrival to its last output: what it asked for, where it is in the caches, what it
has produced, and why it ended. The scheduler reads and moves its scheduling fields; the engine's postprocess
appends its sampled tokens (append_token), which detokenizes and decides when it stops; the caller gets deltas of
its output (take_output). Nothing here knows the model or the tokenizer: the detokenizer is handed in (anything
with `add(token_id) -> str` and `flush() -> str`).

Streamed text never contains a prefix of a stop string that a later token could complete: the last
len(longest stop string) - 1 characters are held back until the request finishes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where the scheduler has it; whether it has ended is its finish_reason."""
    WAITING = "waiting"      # queued, holds nothing
    RUNNING = "running"      # admitted: its tokens are being scheduled; holds a state slot and its KV blocks
    RELEASED = "released"    # out of the scheduler (all its tokens scheduled, or it ended): holds nothing


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), as streamed to the caller."""
    request_id: str
    text: str                    # new text since the previous output
    token_ids: list[int]         # new token ids since the previous output (a stop token included, its text not)
    finished: bool
    finish_reason: str | None    # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_completion_tokens: int   # all tokens generated so far, a final stop token included
    error: str | None = None     # why, when finish_reason is "error"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()   # the model's; params.stop_token_ids replaces them
    detokenizer: object = None            # incremental: add(token_id) -> new text, flush() -> the rest
    # ---- scheduling (the scheduler's) --------------------------------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0       # tokens written, or scheduled to be written, into its KV blocks and DeltaNet state
    num_scheduled: int = 0      # completion tokens scheduled to be sampled (the last may still be on the device)
    state_slot: int | None = None
    block_ids: list[int] = field(default_factory=list)  # every block it may need, reserved at admission
    # prefix cache (scheduler/prefix_cache.py): the chain of cached blocks this request is on (the root, then a node
    # per full block: its first num_shared_blocks were read from the cache at admission, later ones it computed
    # itself), and the positions still to snapshot as its prefill passes them: (position, speculative)
    cache_path: list = field(default_factory=list)
    num_shared_blocks: int = 0
    snapshots: list[tuple[int, bool]] = field(default_factory=list)
    # ---- output (the postprocess's) ----------------------------------------------------------------------------
    output_ids: list[int] = field(default_factory=list)  # completion tokens received from the device
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self):
        ids = self.eos_token_ids if self.params.stop_token_ids is None else self.params.stop_token_ids
        # ignore_eos disables stop tokens only (benchmarks fix output lengths); stop strings still apply
        self.stop_token_ids: tuple[int, ...] = () if self.params.ignore_eos else tuple(dict.fromkeys(ids))
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1
        self._checked = 0       # text length already searched for stop strings
        self._sent_chars = 0
        self._sent_tokens = 0

    # ---- scheduling views -----------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_cached_tokens(self) -> int:
        """Most tokens this request can ever feed the model: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def suppressed_ids(self, num_before: int) -> tuple[int, ...]:
        """Token ids the sampler must not pick for the completion token that follows `num_before` others: the stop
        tokens, until min_tokens completion tokens exist."""
        return self.stop_token_ids if num_before < self.params.min_tokens else ()

    # ---- output -----------------------------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        """Add one sampled token; sets finish_reason when the request is done."""
        assert not self.is_finished
        self.output_ids.append(token_id)
        n = len(self.output_ids)
        if token_id in self.stop_token_ids and n > self.params.min_tokens:
            self._finish("stop")
            return
        self.text += self.detokenizer.add(token_id)
        if self.params.stop and n >= self.params.min_tokens and self._cut_at_stop_string():
            self.finish_reason = "stop"
            return
        self._checked = len(self.text)
        if n >= self.params.max_tokens:
            self._finish("length")

    def _cut_at_stop_string(self) -> bool:
        # a new match must end in text added since the last check, so it starts at most _hold chars before it
        start = max(0, self._checked - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def _finish(self, reason: str) -> None:
        # an unfinished UTF-8 character at the end renders as U+FFFD, as a full decode() shows it
        self.text += self.detokenizer.flush()
        self.finish_reason = reason

    def abort(self) -> None:
        self.finish_reason = "abort"

    def fail(self, error: Exception) -> None:
        """End the request with an error of its own; the text already sent stands, held-back text is dropped."""
        self.text = self.text[:self._sent_chars]
        self.finish_reason, self.error = "error", f"{type(error).__name__}: {error}"

    def take_output(self) -> RequestOutput:
        """The delta since the previous call."""
        done = self.is_finished
        end = len(self.text) if done else max(self._sent_chars, len(self.text) - self._hold)
        text, self._sent_chars = self.text[self._sent_chars:end], end
        ids, self._sent_tokens = self.output_ids[self._sent_tokens:], len(self.output_ids)
        return RequestOutput(self.request_id, text, ids, done, self.finish_reason, len(self.prompt_ids),
                             len(self.output_ids), self.error)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this engine, checked once where requests come in (the server, the offline LLM);
    the engine behind that boundary trusts what it is given. Reads only constants: safe from any thread."""
    vocab_size: int       # token ids the model has rows for
    max_model_len: int    # prompt + completion
    num_kv_blocks: int
    block_size: int

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem when the request can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")
        n = len(prompt_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                             f"exceeds max_model_len ({self.max_model_len})")
        # the last sampled token is never fed back, so it needs no cache room
        need = -(-(n + params.max_tokens - 1) // self.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of {self.block_size} "
                f"tokens, but the KV cache holds only {self.num_kv_blocks} blocks "
                f"({self.num_kv_blocks * self.block_size} tokens)")
