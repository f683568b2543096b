"""How many drafts a step verifies (speculative decoding with the MTP head, qwen35/mtp.py): the engine setting
`speculative_tokens` (K >= 1: K drafts on every pure-decode step; 0: off; "auto": chosen per step), the running
acceptance, and the cost table `auto` chooses by.

The drafts a step verifies were proposed at the end of the step before, so k is chosen one step ahead: the
scheduler asks `next_k(batch)` when it plans a step (the drafts that step proposes), and the step after verifies at
most that many (none while a row's stop ids are suppressed: Scheduler).

`auto`: with acceptance a per draft (the probability that a draft is accepted given the ones before it were: an
exponential average of the a that explains each verify step's accepted / drafted; ACCEPTANCE_PRIOR before any), a
step of k drafts per row emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per row on average and costs
step(batch x (k + 1) tokens) + k x draft_cost x step(batch tokens); auto takes the k in 0..AUTO_MAX_K with the least
expected cost per emitted token (k = 0: a plain step; ties go to the smaller k), keeping the k it chose last unless
another is expected to cost SWITCH_MARGIN less: a verify step replays a CUDA graph only when it proposes as many
drafts as it verifies (qwen35/cuda_graphs.py VerifyGraphs), so a k that flips between two near-equal choices as the
running acceptance moves would make every step eager. While auto stays at 0 the average relaxes back towards the
prior, so that speculation is tried again once in a while rather than never.

The cost table: COST_TABLE below is a placeholder of the right shape, NOT a measurement (to be replaced by the
table `qwen35.bench --mode spec` measures, per GPU kind and TP). It is the cost of a step relative to a batch-1
plain step, by tokens in the step (batch x (k + 1)); the points at 2 and 4 tokens take the ratios issue #28
quotes for steps of 2 and 4 sequences on one H200 (1.32x, 1.82x; a verify step of n positions of one sequence may
cost less), the rest is a guess that grows slower than linearly as a batch reads most
experts anyway. A draft step (the MTP layer and an LM head) is taken as DRAFT_COST of a step of the same batch.
CostTable.from_json overrides both (EngineArgs.spec_cost_table).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

AUTO_MAX_K = 3            # the most drafts `auto` chooses
MAX_K = 8                 # the most drafts a fixed --speculative-tokens may ask for
ACCEPTANCE_PRIOR = 0.6    # the acceptance `auto` assumes before it has measured any
ACCEPTANCE_DECAY = 0.9    # weight of the past in the running acceptance (per verify step)
# placeholder (module docstring): (tokens in the step, cost relative to a batch-1 plain step)
COST_TABLE = [(1, 1.0), (2, 1.32), (4, 1.82), (8, 2.4), (16, 3.0), (32, 3.6), (64, 4.3), (128, 5.6), (256, 8.4),
              (512, 14.0)]
DRAFT_COST = 0.15
SWITCH_MARGIN = 0.03      # auto leaves the k it chose last only for one expected to cost this much less per token


def parse_speculative_tokens(value) -> int | str:
    """The setting as given (CLI string, int): K (0..MAX_K) or "auto"; ValueError naming the flag otherwise."""
    if isinstance(value, str):
        if value == "auto":
            return value
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"--speculative-tokens must be an integer 0..{MAX_K} or 'auto'; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_K:
        raise ValueError(f"--speculative-tokens must be an integer 0..{MAX_K} or 'auto'; got {value!r}")
    return value


def max_drafts(setting) -> int:
    """The most drafts a step may verify under the setting (the runner's draft buffer width)."""
    setting = parse_speculative_tokens(setting)
    return AUTO_MAX_K if setting == "auto" else setting


@dataclass
class CostTable:
    points: list[tuple[int, float]] = field(default_factory=lambda: list(COST_TABLE))
    draft_cost: float = DRAFT_COST

    @classmethod
    def from_json(cls, path: str) -> "CostTable":
        """{"points": [[tokens, ms], ...], "draft_cost": fraction}: any unit, only ratios matter."""
        with open(path) as f:
            raw = json.load(f)
        points = sorted((int(n), float(ms)) for n, ms in raw["points"])
        if not points or any(ms <= 0 for _, ms in points):
            raise ValueError(f"{path}: a cost table needs points [[tokens, ms], ...] with ms > 0")
        return cls(points, float(raw.get("draft_cost", DRAFT_COST)))

    def step(self, tokens: int) -> float:
        """Cost of a step of `tokens` tokens: linear between the points, flat before the first, and the last
        segment's slope past the last."""
        xs = [n for n, _ in self.points]
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return self.points[i][1]
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            i = len(xs) - 1
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def ms_per_token(self, batch: int, k: int, acceptance: float) -> float:
        """Expected cost per emitted token of a step of `batch` rows with k drafts each at this acceptance."""
        a = min(max(acceptance, 0.0), 0.999)
        emitted = (1 - a ** (k + 1)) / (1 - a)
        cost = self.step(batch * (k + 1)) + (k * self.draft_cost * self.step(batch) if k else 0.0)
        return cost / emitted


class SpecPolicy:
    """The setting, the running acceptance and the counters /metrics reports (drafted, accepted)."""

    def __init__(self, setting, table: CostTable | None = None):
        self.setting = parse_speculative_tokens(setting)
        self.table = table or CostTable()
        self.acceptance = ACCEPTANCE_PRIOR
        self.k: int | None = None  # what auto chose last
        self.drafted = 0
        self.accepted = 0

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    def next_k(self, batch: int) -> int:
        """Drafts to propose for the next step of about `batch` rows."""
        if self.setting != "auto":
            return self.setting
        costs = [self.table.ms_per_token(batch, k, self.acceptance) for k in range(AUTO_MAX_K + 1)]
        best = min(range(AUTO_MAX_K + 1), key=costs.__getitem__)  # (ties: the smaller k)
        if self.k is not None and costs[self.k] * (1 - SWITCH_MARGIN) <= costs[best]:
            best = self.k  # (module docstring: k stays put unless another is clearly cheaper)
        self.k = best
        if best == 0:  # relax towards the prior: try again once in a while
            self.acceptance = ACCEPTANCE_DECAY * self.acceptance + (1 - ACCEPTANCE_DECAY) * ACCEPTANCE_PRIOR
        return best

    def record(self, drafted: int, accepted: int, k: int) -> None:
        """A verify step of k drafts per row: `drafted` drafts that could have been accepted (a row near its end
        has fewer), `accepted` of them accepted."""
        if drafted <= 0 or k <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        a = per_draft_acceptance(accepted / drafted, k)
        self.acceptance = ACCEPTANCE_DECAY * self.acceptance + (1 - ACCEPTANCE_DECAY) * a


def per_draft_acceptance(ratio: float, k: int) -> float:
    """The a with (a + a^2 + ... + a^k) / k = ratio (accepted / drafted of steps of k drafts), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        if sum(a ** j for j in range(1, k + 1)) / k < ratio:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2
