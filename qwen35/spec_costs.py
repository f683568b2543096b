"""What a step costs by batch and k, measured in the engine: the rows of `qwen35.bench --mode spec` and the cost table
`--speculative-tokens auto` chooses by (scheduler/speculation.py CostTable), measured at start where none ships.

A row (measure_row): B requests of `input_len` random prompt tokens, sampled at temperature 1, ignore_eos,
`output_len` tokens each, all added at once; the prefill steps are not timed, then every step until all have
finished is. Reported: wall ms per step (host included; the engine overlaps the host's work with the device's as in
serving), completion tokens per sequence per step, the effective ms per emitted token, the acceptance measured in
that run (accepted / drafted drafts that could count), and how many verify steps replayed a CUDA graph and how many
ran eagerly. The same over the steps while all B requests ran (`full_*`): with k > 0 the requests end at different
steps, and the steps after the first ends run fewer rows at nearly a full step's cost, which a served batch (refilled
as requests end) does not; the cost table takes these. The policy's setting is the row's k while it runs.

measure_table: a row per batch (the verify graphs' sizes up to START_MAX_BATCH and max_num_seqs) and k (0 to
AUTO_MAX_K) after a short warm-up row per k, then the engine as it was: the setting back, the running acceptance
back to its prior (random prompts say nothing of the served ones' drafts), the prefix cache emptied of the random
prompts. A step's cost hardly depends on the drafts accepted (CostTable.from_rows scales each row to the tokens it
emitted), so random weights and random prompts measure it as well as the served text would.
"""
from __future__ import annotations

import contextlib
import logging
import random
import time

from qwen35.engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from scheduler.speculation import AUTO_MAX_K, CostTable

log = logging.getLogger("qwen35.spec_costs")

START_MAX_BATCH = 64     # the largest batch measured at start (past it the table holds the last value)
START_INPUT_LEN = 1024   # prompt tokens of the rows measured at start (the users' prompts: ~1,036)
START_OUTPUT_LEN = 64    # tokens each row's requests emit (as the shipped tables' runs: at k = 3 and batch 64 the
                         # first request ends after ~20 steps, the window the table takes)


def prompt_vocab(engine: LLMEngine) -> int:
    """Random prompt ids below this: ordinary tokens of the tokenizer that the model's vocabulary also has."""
    return min(engine.tokenizer.num_real_tokens - 33, engine.config.vocab_size)


def measure_row(engine: LLMEngine, batch: int, k, input_len: int, output_len: int, rng: random.Random,
                timed=contextlib.nullcontext) -> dict:
    """One row (module docstring); `timed()` a context around the timed steps (a profiler)."""
    policy = engine.speculation
    policy.setting = k
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    vocab = prompt_vocab(engine)
    for i in range(batch):
        engine.add_request(f"spec-{batch}-{k}-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    while any(not r.output_ids for r in engine.requests.values()):  # the prefill steps, untimed
        engine.step()
    before = sum(len(r.output_ids) for r in engine.requests.values())
    drafted, accepted, steps = policy.drafted, policy.accepted, engine.num_steps
    counts = dict(engine.runner.verify_counts)
    steps -= engine.step_in_flight  # (overlap: a step queued during the prefill loop runs in the window)
    emitted = engine.total_completion_tokens
    full = None  # (wall s, steps, tokens) while all `batch` requests ran
    with timed():
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            if full is None and len(engine.requests) < batch:
                full = (time.perf_counter() - t0, engine.num_steps - engine.step_in_flight - steps,
                        engine.total_completion_tokens - emitted)
        wall = time.perf_counter() - t0
    steps = max(1, engine.num_steps - steps)
    per_seq = (batch * output_len - before) / batch  # tokens each sequence emitted in the timed steps
    drafted, accepted = policy.drafted - drafted, policy.accepted - accepted
    full_wall, full_steps, full_tokens = full if full is not None and full[1] > 0 else (wall, steps, batch * per_seq)
    return {"batch": batch, "k": k, "steps": steps, "step_ms": round(1e3 * wall / steps, 4),
            "tokens_per_step": round(per_seq / steps, 4), "ms_per_token": round(1e3 * wall / max(per_seq, 1), 4),
            "full_steps": full_steps, "full_step_ms": round(1e3 * full_wall / full_steps, 4),
            "full_tokens_per_step": round(full_tokens / batch / full_steps, 4),
            "drafted": drafted, "accepted": accepted,
            "verify_graph_steps": engine.runner.verify_counts["graph"] - counts["graph"],
            "verify_eager_steps": engine.runner.verify_counts["eager"] - counts["eager"],
            "acceptance": round(accepted / drafted, 4) if drafted else None}


def measure_rows(engine: LLMEngine, batches: list[int], ks: list, input_len: int, output_len: int,
                 rng: random.Random, on_row=None) -> list[dict]:
    """Every (batch, k) row, batch by batch, after one short warm-up row per k (first-use costs out of the rows);
    `on_row(row)` after each. The policy's setting is put back after."""
    policy = engine.speculation
    setting = policy.setting
    try:
        for k in ks:
            measure_row(engine, 1, k, 16, 8, rng)
        rows = []
        for b in batches:
            for k in ks:
                rows.append(measure_row(engine, b, k, input_len, output_len, rng))
                if on_row is not None:
                    on_row(rows[-1])
        return rows
    finally:
        policy.setting = setting


def start_batches(max_num_seqs: int) -> list[int]:
    """The batches measured at start: 1, 2, 4, 8, 16, 24, 32, 48, 64 up to max_num_seqs (verify graphs are captured
    at 1, 2, 4, 8 and every 8th from 16: a verify step of 9-15 rows costs what one of 16 does)."""
    return [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b <= min(max_num_seqs, START_MAX_BATCH)]


def measure_table(engine: LLMEngine, batches: list[int] | None = None, ks: list[int] | None = None,
                  input_len: int | None = None, output_len: int | None = None, seed: int = 0) -> CostTable:
    """The cost table of this engine on this machine (module docstring); rank 0, with the other ranks in their
    worker loop. The engine must be idle and its speculation on. Lengths: START_INPUT_LEN / START_OUTPUT_LEN where
    not given (read at the call)."""
    input_len = START_INPUT_LEN if input_len is None else input_len
    output_len = START_OUTPUT_LEN if output_len is None else output_len
    policy = engine.speculation
    if not policy.enabled:
        raise ValueError("measuring a speculation cost table needs the MTP head: --speculative-tokens auto")
    if engine.has_unfinished():
        raise RuntimeError("measure the speculation cost table before serving: the engine has requests")
    batches = batches or start_batches(engine.args.max_num_seqs)
    ks = list(range(AUTO_MAX_K + 1)) if ks is None else ks
    input_len = min(input_len, engine.max_model_len - output_len - AUTO_MAX_K - 1)
    t0 = time.perf_counter()
    try:
        rows = measure_rows(engine, batches, ks, input_len, output_len, random.Random(seed))
    finally:
        policy.forget()
        if engine.scheduler.cache is not None:
            engine.scheduler.cache.evict_all(engine.scheduler.step_no)
    table = CostTable.from_rows(rows, f"measured at start ({len(rows)} rows, {time.perf_counter() - t0:.0f} s)")
    log.info("speculation cost table %s: ms a step at batch %s: %s", table.source, batches,
             "; ".join(f"k={k} " + " ".join(f"{ms:.2f}" for _, ms in table.steps[k]) for k in sorted(table.steps)))
    return table


def measure_at_start(engine: LLMEngine) -> None:
    """Rank 0, the other ranks in their worker loop (a server or LLM, before the first request): the cost table
    `auto` chooses by, measured where the engine has none (LLMEngine.measures_spec_costs)."""
    if engine.measures_spec_costs:
        log.info("measuring the speculation cost table (--spec-cost-table measure, or none ships for this GPU kind "
                 "and TP)")
        engine.speculation.table = measure_table(engine)
        engine.measures_spec_costs = False
