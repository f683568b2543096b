"""The one record of a request, from arrival to its last output: what it asked for, where it is in the caches, what it
has produced, and why it ended. The scheduler reads and moves its scheduling fields; the engine's postprocess
appends its sampled tokens (append_token), which detokenizes and decides when it stops; the caller gets deltas of
its output (take_output); ShortWay takes the tokens of many records at once where they all take take_token's
shortest way (the engine's decode rows). Nothing here knows the model or the tokenizer: the detokenizer is handed
in (anything with `add(token_id) -> str` and `flush() -> str`).

Streamed text never contains a prefix of a stop string that a later token could complete: the last
len(longest stop string) - 1 characters are held back until the request finishes.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, itemgetter, not_

from scheduler.sampling_params import SamplingParams


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
    # ---- output (the postprocess's) ----------------------------------------------------------------------------
    # (the fields a token is taken with come first, and next to each other: fewer cache lines read per token)
    output_ids: list[int] = field(default_factory=list)  # completion tokens received from the device
    finish_reason: str | None = None
    # take_token's shortest way is open (see _open_short_way): set where the conditions it stands for can change.
    # The tokens it takes, output_ids[_sent_tokens:], are only appended there: _settle() accounts for them wherever
    # the text or _sent_tokens is read, and when the way closes
    _short: bool = field(default=False, init=False, repr=False)
    _texts: list = field(init=False, repr=False)  # the detokenizer's whole_texts, or () without one
    # set in __post_init__: the parameters read per token, kept here rather than behind self.params (validated
    # values, not changed later), and the text: what outputs carried already (pieces, joined when read; a slice of
    # output_ids stands for the table's texts of its tokens) and what follows it (held back, or not taken yet); stop
    # strings are searched in the latter only, which holds every character a new match can use
    _stop_set: frozenset = field(init=False, repr=False)
    _stops: tuple[str, ...] = field(init=False, repr=False)
    _max_tokens: int = field(init=False, repr=False)
    _unsent: str = field(init=False, repr=False)
    _sent: list[str | slice] = field(init=False, repr=False)
    _sent_tokens: int = field(init=False, repr=False)
    _num_prompt: int = field(init=False, repr=False)
    _min_tokens: int = field(init=False, repr=False)
    _hold: int = field(init=False, repr=False)
    _sent_chars: int = field(init=False, repr=False)  # (kept with stop strings only: what _cut_at_stop_string needs)
    _checked: int = field(init=False, repr=False)     # text length already searched for stop strings
    stop_token_ids: tuple[int, ...] = field(init=False, repr=False)
    error: str | None = None
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
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._stop_set = _stop_set(self.stop_token_ids)
        self._stops = tuple(params.stop)
        self._min_tokens, self._max_tokens = params.min_tokens, params.max_tokens
        self._sent, self._sent_chars, self._unsent = [], 0, ""
        self._checked = self._sent_tokens = 0
        self._num_prompt = len(self.prompt_ids)  # (the prompt is not changed once here)
        self._texts = getattr(self.detokenizer, "whole_texts", None) or ()
        self._open_short_way()

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

    # ---- output -----------------------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The completion's text so far (a stop string and what follows it removed)."""
        if self._short:
            self._settle()
        sent = self._sent
        if len(sent) > 1 or sent and sent[0].__class__ is slice:  # amortised: joins only new pieces once
            out, table = self.output_ids, self._texts
            sent[:] = ["".join([p if p.__class__ is str else "".join(map(table.__getitem__, out[p])) for p in sent])]
        return (sent[0] if sent else "") + self._unsent

    def append_token(self, token_id: int) -> None:
        """Add one sampled token; sets finish_reason when the request is done."""
        assert self.finish_reason is None
        self._close_short_way()  # until take_output: this token's output is not taken yet
        out = self.output_ids
        out.append(token_id)
        n = len(out)
        if token_id in self._stop_set and n > self._min_tokens:
            self._finish("stop")
            return
        delta = self.detokenizer.add(token_id)
        if delta:
            self._unsent += delta
        if self._stops:
            if n >= self._min_tokens and self._cut_at_stop_string():
                self.finish_reason = "stop"
                return
            self._checked = self._sent_chars + len(self._unsent)
        if n >= self._max_tokens:
            self._finish("length")

    def take_token(self, token_id: int) -> RequestOutput | None:
        """append_token, then take_output: the engine's postprocess, one call per request and step (None: a request
        that does not stream and has not ended). A request with no stop strings (nothing held back) that does not
        stop on this token takes a short way there; the shortest (most tokens, most steps) when, besides, the token
        is not its last: it is appended, and nothing else is done until its text is needed (_settle). For a request
        that streams that is now, and only a token that decodes whole on its own with nothing pending takes this
        way: its text is read from the detokenizer's table, as add() would, and add() is not called."""
        out = self.output_ids
        if self._short:
            if token_id not in self._stop_set and len(out) + 1 < self._max_tokens and token_id >= 0:
                if not self.stream:
                    out.append(token_id)
                    return None
                try:
                    text = self._texts[token_id]
                except IndexError:
                    text = None
                if text:
                    out.append(token_id)
                    return RequestOutput(self.request_id, text, [token_id], False, None, self._num_prompt, len(out),
                                         None)
            self._close_short_way()
        if self._stops or self.finish_reason is not None or token_id in self._stop_set:
            self.append_token(token_id)
            return self.take_output()
        out.append(token_id)
        text = self.detokenizer.add(token_id)
        n = len(out)
        reason = None
        if n >= self._max_tokens:
            text += self.detokenizer.flush()
            self.finish_reason = reason = "length"
        if self._unsent:  # appended before without an output taken
            text, self._unsent = self._unsent + text, ""
        if text:
            self._sent.append(text)  # (_sent_chars is read with stop strings only)
        new, self._sent_tokens = out[self._sent_tokens:], n
        self._open_short_way()
        if not self.stream:
            return self._whole() if reason is not None else None
        return RequestOutput(self.request_id, text, new, reason is not None, reason, self._num_prompt, n, None)

    def _open_short_way(self) -> None:
        """take_token's shortest way is open while every output so far is taken and nothing is held back (no stop
        strings), the request runs, and its detokenizer keeps a table of whole texts with nothing pending; then a
        token with whole text of its own gives exactly what append_token + take_output would. Called wherever one
        of these can change: at creation, after every output taken (its detokenizer was called, or its end came)."""
        d = self.detokenizer
        self._short = (not self._stops and self.finish_reason is None and not self._unsent and bool(self._texts)
                       and self._sent_tokens == len(self.output_ids) and not d.pending)

    def _settle(self) -> None:
        """While the shortest way is open: the tokens it took, output_ids[_sent_tokens:], join the text sent. Those of
        a request that streams went out with their texts, the table's (a slice of output_ids stands for them until
        the text is read); those of one that does not are decoded now, as add() one by one would have (the table's
        texts while nothing is pending, add() itself from a token without whole text of its own until nothing is;
        bytes of a character may be left pending: the way closes then)."""
        out, k = self.output_ids, self._sent_tokens
        n = len(out)
        if n == k:
            return
        self._sent_tokens = n  # (first: should decoding raise, the request fails without trying again)
        if self.stream:
            self._sent.append(slice(k, n))
            return
        ids, table, d = out[k:], self._texts, self.detokenizer
        try:
            texts = itemgetter(*ids)(table) if n - k > 1 else (table[ids[0]],)
        except IndexError:  # a token past the table: add() for every one
            texts = (None,) * (n - k)
        if all(texts):  # each decodes whole on its own: add() would give these and change nothing
            self._sent.append("".join(texts))
            return
        # add() one by one where a token has no whole text of its own, and after it while bytes are pending; the
        # table's texts in between (what add() gives there)
        pieces, i, m = [], 0, len(ids)
        whole = [*map(bool, texts), False]
        while i < m:
            j = whole.index(False, i)
            pieces += texts[i:j]
            if j < m:
                pieces.append(d.add(ids[j]))
                j += 1
                while j < m and d.pending:
                    pieces.append(d.add(ids[j]))
                    j += 1
            i = j
        self._sent.append("".join(pieces))
        self._short = not d.pending

    def _close_short_way(self) -> None:
        if self._short:
            self._settle()
            self._short = False

    def _cut_at_stop_string(self) -> bool:
        # a new match must end in text added since the last check, so it starts at most _hold chars before it; that
        # is never in text already sent (at most len - _hold characters are sent while a request runs)
        start = max(0, self._checked - self._hold - self._sent_chars)
        unsent = self._unsent
        hits = [i for i in (unsent.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self._unsent = unsent[:min(hits)]
        return bool(hits)

    def _finish(self, reason: str) -> None:
        # an unfinished UTF-8 character at the end renders as U+FFFD, as a full decode() shows it
        self._unsent += self.detokenizer.flush()
        self.finish_reason = reason

    def abort(self) -> None:
        self._close_short_way()
        self.finish_reason = "abort"

    def fail(self, error: Exception) -> None:
        """End the request with an error of its own; the text already sent stands, held-back text is dropped."""
        self._close_short_way()
        self._unsent = ""
        self.finish_reason, self.error = "error", f"{type(error).__name__}: {error}"

    def take_output(self) -> RequestOutput | None:
        """The delta since the previous call; for a request that does not stream, None until it has ended, then the
        whole completion."""
        if self._short:
            self._settle()
        reason = self.finish_reason
        text = self._unsent
        if reason is None and self._hold:  # the last _hold characters wait: a stop string may start in them
            keep = len(text) - self._hold
            text, self._unsent = (text[:keep], text[keep:]) if keep > 0 else ("", text)
        else:
            self._unsent = ""
        if text:
            self._sent.append(text)
            self._sent_chars += len(text)
        ids = self.output_ids
        n = len(ids)
        new, self._sent_tokens = ids[self._sent_tokens:], n
        self._open_short_way()
        if not self.stream:
            return self._whole() if reason is not None else None
        return RequestOutput(self.request_id, text, new, reason is not None, reason, len(self.prompt_ids), n,
                             self.error)

    def _whole(self) -> RequestOutput:
        """The final output of a request that does not stream: everything it produced."""
        ids = self.output_ids
        return RequestOutput(self.request_id, self.text, list(ids), True, self.finish_reason, len(self.prompt_ids),
                             len(ids), self.error)


_consume = deque(maxlen=0).extend  # runs an iterator of calls (map) to its end in C, keeping nothing
_is_short = attrgetter("_short")


class ShortWay:
    """Request.take_token for the requests of a list at once (the engine's decode rows), where they take its
    shortest way: with dozens of requests decoding, the host's time per step goes mostly on the Python operations
    and the objects of each request's call, so the common case is done here in a few C-level passes over lists kept
    beside the rows (map, itemgetter), with the result of a take_token per row. The rows are those of
    scheduler.DecodeBatch, one list object for as long as the batch keeps its members: a ShortWay is made for one
    such list and kept as long as it is."""

    __slots__ = ("rows", "taken", "_outs", "_ids", "_num_prompt", "_streams", "_stream", "_stop_sets", "_table")

    def __init__(self, rows: list[Request]):
        self.rows = rows
        self.taken = 0  # rows the last take() took
        # (lists a record keeps and never replaces, and values it never changes)
        self._outs = [r.output_ids for r in rows]
        self._ids = [r.request_id for r in rows]
        self._num_prompt = [r._num_prompt for r in rows]
        self._streams = [r.stream for r in rows]
        self._stream = all(self._streams) or (None if any(self._streams) else False)  # None: some rows stream
        self._stop_sets = {r._stop_set for r in rows}  # (most requests share the model's)
        tables = {id(r._texts) for r in rows}
        self._table = rows[0]._texts if len(tables) == 1 else ()

    def take(self, tokens: list[int], outputs: list[RequestOutput]):
        """take_token(tokens[i]) for each row i in turn, where its token takes the shortest way, its output appended
        to `outputs`; each other row (a request not on that way: stop strings, something pending, ended; a stop
        token of any row; for rows that stream, a token without whole text of its own) is yielded, (request,
        token), when its turn comes, for the caller to take. `tokens` may go on past the rows. The caller knows
        that no row's token is its request's last (max_tokens): that is not checked here."""
        rows = self.rows
        n = len(rows)
        if len(tokens) > n:
            tokens = tokens[:n]
        texts = self._texts_of(tokens)
        if texts is False:  # (not with a sampler's tokens)
            left = range(n)
        elif ((texts is None or all(texts)) and all(map(_is_short, rows))
              and all(s.isdisjoint(tokens) for s in self._stop_sets)):  # the common case: every row at once
            self.taken = n
            self._take(0, n, tokens, texts, outputs)
            return
        else:
            left = self._left(tokens, texts)
        self.taken = n - len(left)
        lo = 0
        for i in left:
            if lo < i:
                self._take(lo, i, tokens, texts, outputs)
            yield rows[i], tokens[i]
            lo = i + 1
        if lo < n:
            self._take(lo, n, tokens, texts, outputs)

    def _texts_of(self, tokens: list[int]) -> tuple | None | bool:
        """The tokens' texts in the table, for the outputs (None: no row streams); False where the table cannot tell
        them: a negative id (it would index the table from its end), one past the table, or no table."""
        if min(tokens) < 0:
            return False
        if self._stream is False:
            return None
        table = self._table
        try:
            return itemgetter(*tokens)(table) if len(tokens) > 1 else (table[tokens[0]],)
        except IndexError:
            return False

    def _take(self, lo: int, hi: int, tokens: list[int], texts: tuple | None, outputs: list[RequestOutput]) -> None:
        """Rows lo..hi-1, on the shortest way with these tokens: what take_token does there, for all at once."""
        outs = self._outs
        part = lo or hi < len(outs)  # (a run of the rows, not all of them)
        if part:
            outs, tokens = outs[lo:hi], tokens[lo:hi]
        _consume(map(list.append, outs, tokens))
        if texts is None:  # no row streams
            return
        ids, num_prompt, streams = self._ids, self._num_prompt, self._streams
        if part:
            ids, num_prompt, streams, texts = ids[lo:hi], num_prompt[lo:hi], streams[lo:hi], texts[lo:hi]
        counts = list(map(len, outs))
        if self._stream is None:  # some rows stream: theirs only
            ids, texts, tokens, num_prompt, counts = (
                list(compress(x, streams)) for x in (ids, texts, tokens, num_prompt, counts))
        outputs += map(RequestOutput, ids, texts, [[t] for t in tokens], repeat(False), repeat(None), num_prompt,
                       counts, repeat(None))

    def _left(self, tokens: list[int], texts: tuple | None) -> list[int]:
        """The rows whose tokens do not take the shortest way, in order."""
        rows = range(len(self.rows))
        left = set(compress(rows, map(not_, map(_is_short, self.rows))))
        if texts is not None:
            left.update(compress(rows, map(not_, texts)))
        for stops in self._stop_sets:
            left.update(compress(rows, map(stops.__contains__, tokens)))
        return sorted(left)


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
