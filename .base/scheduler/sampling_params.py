"""Per-request generation settings (the offline API's and the server's common currency).

A leaf module (it imports nothing of the project): the scheduler's request record holds one, qwen35 re-exports it,
and the sampler never sees it (it takes the tensors that `sampler_row` values fill).
"""
from __future__ import annotations

from dataclasses import dataclass, field


MAX_TEMPERATURE = 100.0
# Below this a temperature samples as greedy: logits / T overflows float32 to inf (then NaN probabilities) once T is
# tiny, and long before that the distribution is already a one-hot on the argmax.
GREEDY_TEMPERATURE = 1e-5
INT64 = (-2**63, 2**63)  # what torch generators and index tensors can hold


class RequestError(ValueError):
    """A request that can never run, found where it comes in (SamplingParams, RequestLimits): the message names the
    problem; `field` is the request field it is about (a SamplingParams field, or "prompt") and `code` a kind a
    client can act on ("context_length_exceeded"), for the server's error body."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = no top-k
    max_tokens: int = 256
    min_tokens: int = 0               # suppress stop tokens before this many completion tokens
    stop: list[str] = field(default_factory=list)        # stop strings, matched on detokenized text, removed
    stop_token_ids: list[int] | None = None              # None = the model's EOS ids (generation_config.json)
    ignore_eos: bool = False          # benchmarks: never stop on EOS / stop tokens
    seed: int | None = None           # same seed, same output

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        try:
            self.temperature = float(self.temperature)
            self.top_p = float(self.top_p)
            self.top_k = int(self.top_k or 0)
            self.max_tokens = int(self.max_tokens)
            self.min_tokens = int(self.min_tokens or 0)
        except (TypeError, OverflowError) as e:  # e.g. float(10**400): a parameter error like any other
            raise RequestError(f"invalid sampling parameter: {e}") from e
        self.validate()  # (once: what is made here is trusted from then on)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def sampler_row(self) -> tuple[float, float, float]:
        """(temperature, top_k, top_p) as the sampler's tensors hold them: temperature 0 for a greedy row, top_k 0
        for none. top_k travels as a float32, exact for every k up to 2**24, far past any vocabulary; a larger k
        keeps the whole vocabulary all the same."""
        return (0.0 if self.greedy else self.temperature), float(min(self.top_k, 1 << 24)), self.top_p

    def validate(self) -> None:
        """Raise RequestError naming the bad field (the server turns it into an HTTP 400). Bounds every number, so
        nothing that passes can overflow a tensor or index outside the vocabulary later (RequestLimits checks ids
        against the model's vocabulary)."""
        # past ~100 the distribution is uniform to fp32 precision; huge values would overflow logits / T
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                               "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.top_k < INT64[1]:
            raise RequestError(f"top_k must be >= 0 (0 = no top-k) and fit in 64 bits, got {self.top_k}", "top_k")
        if not 1 <= self.max_tokens < INT64[1]:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a list of non-empty strings", "stop")
        if self.stop_token_ids is not None and not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < INT64[1] for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of non-negative token ids", "stop_token_ids")
        if self.seed is not None:
            try:
                self.seed = int(self.seed)
            except (TypeError, ValueError) as e:
                raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed") from e
            if not INT64[0] <= self.seed < INT64[1]:
                raise RequestError(f"seed must fit in a signed 64-bit integer, got {self.seed}", "seed")
