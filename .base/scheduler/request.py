"""The one record of a request, from arrival to its last output: what it asked for, where it is in the caches, what it
has produced, and why it ended. The scheduler reads and moves its scheduling fields, and takes each sampled token
into it (Scheduler.update, which alone decides when the request ends); the caller gets deltas of its output
(take_output). Nothing here knows the model or the tokenizer: the detokenizer is handed in (anything with
`add(token_id) -> str` and `flush() -> str`).

Streamed text never contains a prefix of a stop string that a later token could complete: the last
len(longest stop string) - 1 characters are held back until the request finishes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.sampling_params import RequestError, SamplingParams


class RequestStatus(enum.Enum):
    """Where the scheduler has it; whether it has ended is its finish_reason."""
    WAITING = "waiting"      # queued, holds nothing
    RUNNING = "running"      # admitted: its tokens are being scheduled; holds a state slot and its KV blocks
    RELEASED = "released"    # out of the scheduler (all its tokens scheduled, or it ended): holds nothing


@dataclass(slots=True)
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


_STOP_SETS: dict[tuple[int, ...], frozenset] = {}


def _stop_set(ids: tuple[int, ...]) -> frozenset:
    """One set object per distinct stop ids (most requests share the model's): fewer objects read per token."""
    found = _STOP_SETS.get(ids)
    if found is None:
        found = frozenset(ids)
        if len(_STOP_SETS) < 1024:
            _STOP_SETS[ids] = found
    return found


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()   # the model's; params.stop_token_ids replaces them
    detokenizer: object = None            # incremental: add(token_id) -> new text, flush() -> the rest
    stream: bool = True                   # False: no output until it ends, then one with the whole completion
    # ---- output --------------------------------------------------------------------------------------------------
    output_ids: list[int] = field(default_factory=list)  # completion tokens received from the device
    finish_reason: str | None = None
    error: str | None = None
    # set in __post_init__: what the scheduler reads per token (Scheduler.update), kept here rather than behind
    # self.params (validated values, not changed later)
    stop_set: frozenset = field(init=False, repr=False)         # stop token ids (EOS or stop_token_ids)
    stops: tuple[str, ...] = field(init=False, repr=False)      # stop strings
    min_tokens: int = field(init=False, repr=False)
    max_tokens: int = field(init=False, repr=False)
    stop_token_ids: tuple[int, ...] = field(init=False, repr=False)
    # the text: what outputs carried already (pieces, joined when read), and what follows it (held back, or not
    # taken yet); stop strings are searched in the latter only, which holds every character a new match can use
    _unsent: str = field(init=False, repr=False)
    sent: list[str] = field(init=False, repr=False)
    sent_tokens: int = field(init=False, repr=False)  # output_ids[:sent_tokens] went out in outputs
    _sent_chars: int = field(init=False, repr=False)
    num_prompt: int = field(init=False, repr=False)
    _hold: int = field(init=False, repr=False)
    _checked: int = field(init=False, repr=False)     # text length already searched for stop strings
    # the detokenizer's table of whole token texts (IncrementalDetokenizer.whole_texts; () without one), and the
    # same while nothing is pending in it, else (): where Scheduler.update reads most tokens' texts, as add() would
    # give them without changing anything
    text_table: list | tuple = field(init=False, repr=False)
    token_texts: list | tuple = field(init=False, repr=False)
    # ---- scheduling (the scheduler's) --------------------------------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    # num_computed and num_scheduled (properties below) are these plus the steps its decode batch has taken
    _computed: int = field(default=0, init=False, repr=False)
    _scheduled: int = field(default=0, init=False, repr=False)
    _batch: object = field(default=None, init=False, repr=False)
    admission_no: int = field(default=-1, init=False, repr=False)  # admitted as the scheduler's n-th request
    state_slot: int | None = None
    block_ids: list[int] = field(default_factory=list)  # every block it may need, reserved at admission
    # prefix cache (scheduler/prefix_cache.py): the chain of cached blocks this request is on (the root, then a node
    # per full block: its first num_shared_blocks were read from the cache at admission, later ones it computed
    # itself), and the positions still to snapshot as its prefill passes them: (position, speculative)
    cache_path: list = field(default_factory=list)
    num_shared_blocks: int = 0
    snapshots: list[tuple[int, bool]] = field(default_factory=list)

    def __post_init__(self):
        params = self.params
        ids = self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        # ignore_eos disables stop tokens only (benchmarks fix output lengths); stop strings still apply
        self.stop_token_ids = () if params.ignore_eos else tuple(dict.fromkeys(ids))
        self.stop_set = _stop_set(self.stop_token_ids)
        self.stops = tuple(params.stop)
        self.min_tokens, self.max_tokens = params.min_tokens, params.max_tokens
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent, self._sent_chars, self._unsent = [], 0, ""
        self._checked = self.sent_tokens = 0
        self.num_prompt = len(self.prompt_ids)  # (the prompt is not changed once here)
        d = self.detokenizer
        self.text_table = getattr(d, "whole_texts", None) or ()
        self.token_texts = () if getattr(d, "pending", True) else self.text_table

    # ---- scheduling views -----------------------------------------------------------------------------------
    # Once its prefill is scheduled, the scheduler moves it on by one token per step together with every other
    # decoding request (its DecodeBatch, an object with a `steps` count): these two counts are then the values
    # stored here plus the steps that batch has taken since this request joined it, so that a step touches no
    # request.
    @property
    def num_computed(self) -> int:
        """Tokens written, or scheduled to be written, into its KV blocks and DeltaNet state."""
        b = self._batch
        return self._computed if b is None else self._computed + b.steps

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        b = self._batch
        self._computed = value if b is None else value - b.steps

    @property
    def num_scheduled(self) -> int:
        """Completion tokens scheduled to be sampled (the last may still be on the device)."""
        b = self._batch
        return self._scheduled if b is None else self._scheduled + b.steps

    @num_scheduled.setter
    def num_scheduled(self, value: int) -> None:
        b = self._batch
        self._scheduled = value if b is None else value - b.steps

    def join_batch(self, batch) -> None:
        """From now on the counts also move with `batch.steps` (from its value now)."""
        self.leave_batch()
        self._computed -= batch.steps
        self._scheduled -= batch.steps
        self._batch = batch

    def leave_batch(self) -> None:
        """The counts stop moving with the batch (they keep their values)."""
        b = self._batch
        if b is not None:
            self._computed += b.steps
            self._scheduled += b.steps
            self._batch = None

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

    # ---- output: what the scheduler does with a sampled token, and what the caller takes ---------------------------
    @property
    def text(self) -> str:
        """The completion's text so far (a stop string and what follows it removed)."""
        sent = self.sent
        if len(sent) > 1:  # amortised: joins only new pieces once
            sent[:] = ["".join(sent)]
        return (sent[0] if sent else "") + self._unsent

    def detokenize(self, token_id: int) -> str:
        """The text a token adds, from the detokenizer itself (add()): for one whose text is not in token_texts."""
        d = self.detokenizer
        text = d.add(token_id)
        self.token_texts = () if d.pending else self.text_table
        return text

    def append_token(self, token_id: int, text: bool = True) -> None:
        """Add one sampled token and its text (not with `text` False: a stop token that ends the request), to be
        searched for stop strings and taken (take_output). (Scheduler.update writes out the same for a token that
        ends nothing of a request without stop strings, and takes its output at once.)"""
        self.output_ids.append(token_id)
        if text:
            delta = self.detokenizer.add(token_id)
            if delta:
                self._unsent += delta
        self.token_texts = ()  # (the detokenizer may now be pending)

    def cut_at_stop_string(self, search: bool = True) -> bool:
        """Whether a stop string ends in the text added since the last call; the text is cut before the earliest.
        `search` False: none counts yet (before min_tokens), that text is passed over. A new match starts at most
        _hold chars before that text, never in text already sent (at most len - _hold characters are sent while a
        request runs)."""
        unsent = self._unsent
        if search:
            start = max(0, self._checked - self._hold - self._sent_chars)
            hits = [i for i in (unsent.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self._unsent = unsent[:min(hits)]
                return True
        self._checked = self._sent_chars + len(unsent)
        return False

    def finish(self, reason: str, flush: bool = True) -> None:
        """End it with `reason` ("stop", "length", "abort"). `flush`: the detokenizer's pending bytes end the text (an
        unfinished UTF-8 character at the end renders as U+FFFD, as a full decode() shows it)."""
        if flush:
            self._unsent += self.detokenizer.flush()
        self.finish_reason = reason

    def abort(self) -> None:
        self.finish_reason = "abort"

    def fail(self, error: Exception) -> None:
        """End the request with an error of its own; the text already sent stands, held-back text is dropped."""
        self._unsent = ""
        self.finish_reason, self.error = "error", f"{type(error).__name__}: {error}"

    def take_output(self) -> RequestOutput | None:
        """The delta since the previous call; for a request that does not stream, None until it has ended, then the
        whole completion."""
        reason, text = self.finish_reason, self._unsent
        if reason is None and self._hold:  # the last _hold characters wait: a stop string may start in them
            keep = len(text) - self._hold
            text, self._unsent = (text[:keep], text[keep:]) if keep > 0 else ("", text)
        else:
            self._unsent = ""
        if text:
            self.sent.append(text)
            self._sent_chars += len(text)
        ids = self.output_ids
        if not self.stream:
            return None if reason is None else self._whole()
        n = len(ids)
        new, self.sent_tokens = ids[self.sent_tokens:], n
        return RequestOutput(self.request_id, text, new, reason is not None, reason, self.num_prompt, n,
                             self.error)

    def _whole(self) -> RequestOutput:
        """The one output of a request that does not stream, once it has ended: everything it produced."""
        ids = self.output_ids
        return RequestOutput(self.request_id, self.text, list(ids), True, self.finish_reason, self.num_prompt,
                             len(ids), self.error)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this engine, checked once where requests come in (the server, the offline LLM), on
    top of what SamplingParams checked when it was made; the engine behind that boundary trusts what it is given.
    Reads only constants: safe from any thread."""
    vocab_size: int       # token ids a prompt or a stop id may use: the tokenizer's real tokens
    max_model_len: int    # prompt + completion
    num_kv_blocks: int
    block_size: int

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """RequestError (a ValueError) naming the problem when the request can never run."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise RequestError("prompt must contain at least one token", "prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            raise RequestError(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        n, m = len(prompt_ids), params.max_tokens
        # the prompt alone leaves no room: its fault, else max_tokens asks too much
        field = "prompt" if n >= self.max_model_len else "max_tokens"
        if n + m > self.max_model_len:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds max_model_len "
                               f"({self.max_model_len})", field, "context_length_exceeded")
        # the last sampled token is never fed back, so it needs no cache room
        need = -(-(n + m - 1) // self.block_size)
        if need > self.num_kv_blocks:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({m}) needs {need} KV blocks of {self.block_size} tokens, but the "
                f"KV cache holds only {self.num_kv_blocks} blocks ({self.num_kv_blocks * self.block_size} tokens)",
                field, "context_length_exceeded")
