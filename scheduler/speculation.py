"""How many drafts a step verifies (speculative decoding with the MTP head, qwen35/mtp.py): the engine setting
`speculative_tokens` (K >= 1: K drafts on every pure-decode step; 0: off; "auto": chosen per step), the running
acceptance, and the cost table `auto` chooses by.

The drafts a step verifies were proposed at the end of the step before, so k is chosen one step ahead: the
scheduler asks `next_k(batch)` when it plans a step (the drafts that step proposes), and the step after verifies at
most that many (none while a row's stop ids are suppressed: Scheduler).

`auto`: with acceptance a per draft (the probability that a draft is accepted given the ones before it were), a
step of k drafts per row emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per row on average; auto takes the k in
0..AUTO_MAX_K with the least step_ms(batch, k) / E(k) (k = 0: a plain step; ties go to the smaller k), keeping the
k it chose last unless another is expected to cost SWITCH_MARGIN less: a verify step replays a CUDA graph only when
it proposes as many drafts as it verifies (qwen35/cuda_graphs.py VerifyGraphs), so a k that flips between two
near-equal choices as the running acceptance moves would make every step eager.
The running a weighs evidence in drafts: each verify step adds its d drafts (at most STEP_DRAFTS: a large
batch's step would otherwise outweigh all before it and flip k on its noise) at the a that explains its accepted /
drafted, the evidence before it kept by exp(-d / ACCEPTANCE_MEMORY) (so a batch-1 step of one draft moves a as
little as one draft says), and a prior of PRIOR_DRAFTS drafts at ACCEPTANCE_PRIOR is always added. While auto stays
at 0 the evidence fades by e every RETRY_STEPS steps, so that the prior comes back and speculation is tried again,
rarely after much evidence of a low acceptance, soon after little. Each time in a row that the evidence switched it
off (at a batch where the prior's acceptance would speculate), the fade takes twice as long, at most
2^RETRY_DOUBLINGS times; a running acceptance back at the prior resets that. (A retry adds one verify step's few
drafts, and where speculation pays at a low acceptance the evidence fades back past the break-even within ~35 steps:
drafts never accepted were verified on 84 of 2,000 batch-1 steps with TP=2's 2026-11-30 table, 24 with the
doubling. An exponential average pulled back to the prior by 10% a plain step had sat at the break-even under random
drafts: at batch 1 it verified on 83% of steps, each draft lowering it by 1%.)

The cost table: wall ms per step by k and batch, as `qwen35.bench --mode spec` measures them (its results JSON is a
table: --spec-cost-table; CostTable.from_rows says how a row becomes a cost), linear between the batches measured.
The tables measured so far ship in scheduler/spec_costs.json, each for one model, GPU kind and TP (CostTable.shipped
picks by the model's sizes, model_shape, the device name and TP). Where none matches, a server on GPUs measures its
own at start (qwen35/spec_costs.py measure_table; `--spec-cost-table measure` asks for it anyway); elsewhere (the
CPU) auto falls back to PLACEHOLDER, which is NOT a measurement: a step of n tokens costing what the points below
say relative to a batch-1 plain step (the points at 2 and 4 tokens are the ratios issue #28 quotes for steps of 2
and 4 sequences on one H200, the rest a guess), plus DRAFT_COST of a plain step per draft.
"""
from __future__ import annotations

import bisect
import json
import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger("qwen35.speculation")

AUTO_MAX_K = 3            # the most drafts `auto` chooses
MAX_K = 8                 # the most drafts a fixed --speculative-tokens may ask for
ACCEPTANCE_PRIOR = 0.6    # the acceptance `auto` assumes before it has measured any
PRIOR_DRAFTS = 10         # the prior's weight, in drafts, always in the running acceptance
ACCEPTANCE_MEMORY = 100   # drafts: a verify step of d drafts keeps exp(-d / this) of the evidence before it. With a
# weight of 0.1 a step at any batch, a batch-1 step's 0-or-1 moved the acceptance by +-0.1 and k flipped every ~10
# steps there, each flip a verify step outside the graphs (tests/test_spec_policy.py: 184 flips in 2,000 simulated
# batch-1 steps at an acceptance of 0.6 with the TP=1 table)
STEP_DRAFTS = 10          # the most drafts of evidence one verify step adds (a step's weight, ~10% at most)
RETRY_STEPS = 200         # steps at k = 0 over which the evidence fades by e (module docstring), doubled for each
RETRY_DOUBLINGS = 3       # switch-off in a row by the evidence, at most this many times (1,600 steps)
# the placeholder (module docstring): (tokens in the step, cost relative to a batch-1 plain step)
# (1024: the 256-512 segment continued, so that steps of up to 256 rows x (AUTO_MAX_K + 1) tokens grow as before)
PLACEHOLDER = [(1, 1.0), (2, 1.32), (4, 1.82), (8, 2.4), (16, 3.0), (32, 3.6), (64, 4.3), (128, 5.6), (256, 8.4),
               (512, 14.0), (1024, 25.2)]
DRAFT_COST = 0.15
SWITCH_MARGIN = 0.03      # auto leaves the k it chose last only for one expected to cost this much less per token
SHIPPED = os.path.join(os.path.dirname(__file__), "spec_costs.json")
MEASURE = "measure"       # --spec-cost-table measure: a table measured at start even where one ships
MODEL_SHAPE = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "vocab_size")  # a shipped table's "model" (model_shape)


def model_shape(config) -> dict:
    """What a shipped cost table must match besides the GPU kind and TP: the model's sizes that set a step's cost
    (a model config's MODEL_SHAPE fields)."""
    return {f: getattr(config, f) for f in MODEL_SHAPE}


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


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Linear between the points (sorted by x), flat outside them (past the last batch measured, auto chooses as
    there: every k's cost is held at its last value)."""
    xs = [p for p, _ in points]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    if i == 0 or i == len(xs):
        return points[0 if i == 0 else -1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostTable:
    """Wall ms per step by k: steps[k] = [(batch, ms), ...] sorted by batch; `source` says where it came from."""
    steps: dict[int, list[tuple[int, float]]]
    source: str

    @classmethod
    def from_rows(cls, rows: list[dict], source: str) -> "CostTable":
        """From `qwen35.bench --mode spec` rows ({"batch", "k", "step_ms"}, and where measured "tokens_per_step"
        and "acceptance"; rows of k "auto" are skipped). A row's cost is its step time as if its steps had emitted
        E(k) tokens per row at the acceptance it measured: step_ms / tokens_per_step x E(k), so that the table
        gives back the ms per token the row measured at that acceptance. Where a row has them, the steps while all
        its requests ran ("full_step_ms", "full_tokens_per_step"): the cost of a step of that batch, as `auto`
        asks it (rows without them include the run's end, where rows finish at different steps and a verify step of
        fewer rows costs nearly a full one). Needs the k = 0 rows (speculation off) and at least one k > 0."""
        steps: dict[int, list[tuple[int, float]]] = {}
        for r in rows:
            k = r["k"]
            if not isinstance(k, int) or r["step_ms"] <= 0:
                continue
            full = "full_step_ms" in r
            cost = float(r["full_step_ms" if full else "step_ms"])
            tokens = r.get("full_tokens_per_step" if full else "tokens_per_step")
            if tokens:
                a = per_draft_acceptance(r["acceptance"], k) if k and r.get("acceptance") is not None else 0.0
                cost = cost / tokens * expected_tokens(k, a)
            steps.setdefault(k, []).append((int(r["batch"]), cost))
        if 0 not in steps or len(steps) < 2:
            raise ValueError(f"{source}: a cost table needs spec rows of k = 0 and of some k > 0 "
                             "(qwen35.bench --mode spec --spec-ks 0,1,2,3)")
        return cls({k: sorted(v) for k, v in steps.items()}, source)

    @classmethod
    def from_json(cls, path: str) -> "CostTable":
        """A `qwen35.bench --mode spec` results file (its "spec" rows)."""
        with open(path) as f:
            raw = json.load(f)
        if "spec" not in raw:
            raise ValueError(f"{path}: not a cost table: expected the results JSON of qwen35.bench --mode spec "
                             "(a \"spec\" list of rows)")
        return cls.from_rows(raw["spec"], path)

    @classmethod
    def placeholder(cls) -> "CostTable":
        batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        steps = {k: [(b, _interpolate(PLACEHOLDER, b * (k + 1)) + k * DRAFT_COST * _interpolate(PLACEHOLDER, b))
                     for b in batches] for k in range(AUTO_MAX_K + 1)}
        return cls(steps, "placeholder (not a measurement)")

    @classmethod
    def shipped(cls, device: str, tp: int, model: dict, path: str = SHIPPED) -> "CostTable | None":
        """The table measured for this model (model_shape) on this GPU kind at this TP (scheduler/spec_costs.json),
        else None."""
        with open(path) as f:
            tables = json.load(f)["tables"]
        for t in tables:
            if t["device"] == device and t["tp"] == tp and t["model"] == model:
                return cls.from_rows(t["spec"], f"{os.path.basename(path)}: {device}, tp={tp}, {t['date']}")
        return None

    def step_ms(self, batch: int, k: int) -> float:
        return _interpolate(self.steps[k], batch)

    def ms_per_token(self, batch: int, k: int, acceptance: float) -> float:
        """Expected cost per emitted token of a step of `batch` rows with k drafts each at this acceptance (k not in
        the table: never chosen)."""
        if k not in self.steps:
            return float("inf")
        return self.step_ms(batch, k) / expected_tokens(k, acceptance)


class SpecPolicy:
    """The setting, the running acceptance and the counters /metrics reports (drafted, accepted)."""

    def __init__(self, setting, table: CostTable | None = None):
        self.setting = parse_speculative_tokens(setting)
        self.table = table or CostTable.placeholder()
        self.evidence = 0.0        # drafts seen, faded (module docstring)
        self.evidence_accepted = 0.0  # of them, weighted by the acceptance that explains each step
        self.k: int | None = None  # what auto chose last
        self.misses = 0            # switch-offs in a row by the evidence (RETRY_DOUBLINGS)
        self.drafted = 0
        self.accepted = 0

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    @property
    def acceptance(self) -> float:
        """The running acceptance per draft: the evidence and the prior (module docstring)."""
        return (self.evidence_accepted + PRIOR_DRAFTS * ACCEPTANCE_PRIOR) / (self.evidence + PRIOR_DRAFTS)

    def assume(self, acceptance: float, drafts: float = ACCEPTANCE_MEMORY) -> None:
        """Set the evidence to `drafts` drafts whose running acceptance is `acceptance` (0..1)."""
        self.evidence = drafts
        self.evidence_accepted = acceptance * (drafts + PRIOR_DRAFTS) - PRIOR_DRAFTS * ACCEPTANCE_PRIOR

    def forget(self) -> None:
        """Back to no evidence (the acceptance its prior) and no k chosen: what the counters say stays."""
        self.evidence = self.evidence_accepted = 0.0
        self.k = None
        self.misses = 0

    def next_k(self, batch: int) -> int:
        """Drafts to propose for the next step of about `batch` rows."""
        if self.setting != "auto":
            return self.setting
        costs = [self.table.ms_per_token(batch, k, self.acceptance) for k in range(AUTO_MAX_K + 1)]
        best = min(range(AUTO_MAX_K + 1), key=costs.__getitem__)  # (ties: the smaller k)
        if self.k is not None and costs[self.k] * (1 - SWITCH_MARGIN) <= costs[best]:
            best = self.k  # (module docstring: k stays put unless another is clearly cheaper)
        if best == 0 and self.k and self._pays_at_prior(batch):
            self.misses += 1  # switched off by the evidence, not the batch: the next retry waits twice as long
        self.k = best
        if best == 0:  # the evidence fades: the prior comes back, and speculation is tried again
            fade = math.exp(-1 / (RETRY_STEPS << min(self.misses, RETRY_DOUBLINGS)))
            self.evidence *= fade
            self.evidence_accepted *= fade
        return best

    def _pays_at_prior(self, batch: int) -> bool:
        """Whether some k > 0 costs less per token than k = 0 at this batch with the prior's acceptance."""
        off = self.table.ms_per_token(batch, 0, ACCEPTANCE_PRIOR)
        return any(self.table.ms_per_token(batch, k, ACCEPTANCE_PRIOR) < off for k in range(1, AUTO_MAX_K + 1))

    def record(self, drafted: int, accepted: int, k: int) -> None:
        """A verify step of k drafts per row: `drafted` drafts that could have been accepted (a row near its end
        has fewer), `accepted` of them accepted."""
        if drafted <= 0 or k <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        d = min(drafted, STEP_DRAFTS)
        keep = math.exp(-d / ACCEPTANCE_MEMORY)
        self.evidence = keep * self.evidence + d
        self.evidence_accepted = keep * self.evidence_accepted + d * per_draft_acceptance(accepted / drafted, k)
        if self.acceptance >= ACCEPTANCE_PRIOR:
            self.misses = 0


def expected_tokens(k: int, acceptance: float) -> float:
    """E(k): tokens a row emits per step of k drafts at this per-draft acceptance (1 + a + ... + a^k)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


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
