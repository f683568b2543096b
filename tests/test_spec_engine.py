"""Speculative decoding through the engine (--speculative-tokens; scheduler/speculation.py, Scheduler.update's runs),
on the tiny preset, fp32, CPU, torch kernels.

- greedy outputs (tokens, text, finish reason, completion count) are identical to --speculative-tokens 0 for k = 1,
  2, 3 and auto, over prompts of several lengths (chunked prefills beside decode rows, several requests at once), with
  max_tokens 1, 2, 3, 4, 5 and 24, a stop token and a stop string that fall inside accepted runs, and min_tokens;
  with the synthetic-acceptance weights (`dummy-spec`: drafts accepted, the runs are long; the measured acceptance
  is > 0.9) and with the checkpoint's own random weights (drafts rejected: rollback on every step).
- TP=2 over gloo (k = 2, dummy-spec): greedy and seeded sampled outputs == TP=1's.
- GPU (bf16, fast kernels, dummy-spec): greedy outputs identical with k = 2 and auto and without speculation; at
  TP=2 on two GPUs with k = 2.
- with every request admitted at once, verify steps queued before the runs of the one before are read (behind):
  outputs equal, stops inside runs and on a run's last token included; requests ending exactly at a block's end
  never get a row past their blocks.
- /metrics reports the drafted and accepted counters; one request through the HTTP server gives the same text as
  without speculation.
"""
import random
from functools import partial

import pytest
import torch

from qwen35.engine import EngineArgs, LLMEngine
from scheduler.sampling_params import SamplingParams
from tests.test_engine import run

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(0, 240_000) for _ in range(n)] for n in (3, 17, 70, 9, 40, 5)]


def make(tiny_dir, k, load_format="dummy-spec", **kw):
    kw = {"max_num_seqs": 4, "max_model_len": 256, "max_num_batched_tokens": 64, "dtype": "float32",
          "device": "cpu", "kernels": "torch", "speculative_tokens": k, "load_format": load_format, **kw}
    return LLMEngine(EngineArgs(model=tiny_dir, **kw))


def requests(reference=None):
    """(rid, prompt, params): max_tokens edges; with the reference outputs, a stop token and a stop string taken
    from the middle of a reference completion (so that they fall inside accepted runs)."""
    out = []
    for i, p in enumerate(PROMPTS):
        out.append((f"m{i}", p, SamplingParams(max_tokens=[1, 2, 3, 4, 5, 24][i], ignore_eos=True)))
    if reference is not None:
        ids, text = reference["long0"][0], reference["long0"][1]
        stop_id = next(t for j, t in enumerate(ids) if j >= 6 and t not in ids[:j])
        out.append(("stop_id", PROMPTS[0], SamplingParams(max_tokens=24, stop_token_ids=[stop_id])))
        piece = text[len(text) // 2:len(text) // 2 + 3]
        out.append(("stop_str", PROMPTS[0], SamplingParams(max_tokens=24, stop=[piece], ignore_eos=True)))
        out.append(("min", PROMPTS[1], SamplingParams(max_tokens=12, min_tokens=7, stop_token_ids=[stop_id])))
    out.append(("long0", PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True)))
    out.append(("long2", PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True)))
    return out


@pytest.fixture(scope="module")
def references(tiny_dir):
    out = {}
    for load_format in ("dummy-spec", "safetensors"):
        eng = make(tiny_dir, 0, load_format)
        first, _ = run(eng, requests())
        final, _ = run(eng, requests(first))
        out[load_format] = final
    return out


@pytest.mark.parametrize("load_format", ["dummy-spec", "safetensors"])
@pytest.mark.parametrize("k", [1, 2, 3, "auto"])
def test_greedy_outputs_equal_speculation_off(tiny_dir, references, load_format, k):
    expected = references[load_format]
    eng = make(tiny_dir, k, load_format)
    got, history = run(eng, requests(expected))
    assert got == expected
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0
    rate = stats["spec_accepted_tokens"] / stats["spec_drafted_tokens"]
    if load_format == "dummy-spec":
        assert rate > 0.9, rate  # greedy drafts of the synthetic weights: accepted (long runs exercised)
    assert expected["stop_id"][2] == "stop" and expected["stop_str"][2] == "stop"
    assert not eng.has_unfinished() and stats["num_running"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


def test_verify_steps_planned_behind_their_runs(tiny_dir, references, monkeypatch):
    """Every request admitted at once (k = 2, dummy-spec), so most verify steps are queued before the runs of the one
    before are read (plan.spec_behind): outputs equal speculation off, stops inside accepted runs and on a run's last
    token included (three neighbouring stop tokens), and everything is freed. (What a stop behind a queued step does
    to the prefix cache is the scheduler's test: these weights' logits do not see the DeltaNet state.)"""
    expected = references["dummy-spec"]
    eng = make(tiny_dir, 2, max_num_seqs=12)
    behind, schedule = [], eng.scheduler.schedule
    monkeypatch.setattr(eng.scheduler, "schedule", lambda b=False: behind.append(b) or schedule(b))
    reqs = [r for r in requests(expected) if r[0] != "min"]  # (its min_tokens would hold verify steps back)
    ids = expected["long0"][0]
    ends = [j for j in (6, 7, 8) if ids[j] not in ids[:j]]
    stops = [(f"stop{j}", PROMPTS[0], SamplingParams(max_tokens=24, stop_token_ids=[ids[j]])) for j in ends]
    got, _ = run(eng, reqs + stops)
    assert {rid: got[rid] for rid, _, _ in reqs} == {rid: expected[rid] for rid, _, _ in reqs}
    assert [(got[f"stop{j}"][0], got[f"stop{j}"][2]) for j in ends] == [(ids[:j + 1], "stop") for j in ends]
    assert len(ends) >= 2 and sum(behind) >= 5 and not all(behind), behind  # (24 tokens at most, ~3 a step)
    assert eng.stats()["kv_blocks_used"] == 0 and eng.stats()["state_slots_used"] == 0


def test_rows_end_at_block_boundaries_with_verify_steps_behind(tiny_dir):
    """Requests whose last position ends a KV block exactly (prompt + max_tokens - 1 a multiple of the block size),
    all admitted at once with k = 2 on dummy-spec weights (long accepted runs): verify steps planned behind never
    plan a row past a request's blocks (the runner refuses such a plan: a server died on one, 2026-11-29), and the
    greedy outputs equal speculation off."""
    rng, bs = random.Random(5), 8
    reqs = []
    for i, max_tokens in enumerate(range(18, 24)):  # (every phase of the runs' ends: 3 tokens a verify step here)
        n = bs * (i + 2) + 1 - max_tokens % bs
        reqs.append((f"b{i}", [rng.randrange(0, 240_000) for _ in range(n)],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    assert all((len(p) + sp.max_tokens - 1) % bs == 0 for _, p, sp in reqs)
    off, _ = run(make(tiny_dir, 0, max_num_seqs=6, block_size=bs), reqs)
    on, _ = run(make(tiny_dir, 2, max_num_seqs=6, block_size=bs), reqs)
    assert on == off


def test_http_server_with_speculation(tiny_dir, tmp_path):
    """./start.sh with --speculative-tokens 2 on the synthetic-acceptance weights: a greedy completion (plain and
    streamed) has the text and usage of the engine without speculation; /metrics counts drafted and accepted
    tokens."""
    import json

    import httpx

    from tests.test_server import free_port, start_tiny, stop_tiny
    prompt, n = PROMPTS[1], 20
    eng = make(tiny_dir, 0)
    want = run(eng, [("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True))])[0]["r"]
    port, log = free_port(), str(tmp_path / "server.log")
    url = start_tiny(port, log, "--load-format", "dummy-spec", "--speculative-tokens", "2", "--max-model-len", "256",
                     "--max-num-seqs", "4")
    try:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == want[1] and r["usage"]["completion_tokens"] == want[3] == n
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want[1]
        metrics = dict(line.split() for line in httpx.get(url + "/metrics").text.splitlines()
                       if line and not line.startswith("#"))
        drafted, accepted = int(metrics["qwen35_spec_drafted_tokens"]), int(metrics["qwen35_spec_accepted_tokens"])
        assert drafted > 0 and accepted / drafted > 0.9
    finally:
        stop_tiny(port, log)


SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)


def tp_requests():
    return [("g0", PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True)),
            ("g2", PROMPTS[2], SamplingParams(max_tokens=9, ignore_eos=True)), ("seeded", PROMPTS[3], SEEDED)]


def tp_tokens_and_accepted(engine: LLMEngine) -> tuple[dict, int]:
    done, _ = run(engine, tp_requests())
    return {rid: v[0] for rid, v in done.items()}, engine.stats()["spec_accepted_tokens"]


def run_tp2(tiny_dir, cache_dir, out, k=2, **kw) -> tuple[dict, int]:
    """tp_requests' tokens and the accepted drafts at TP=2 (kw: the engine's, its device that of the ranks)."""
    from hf_reference import run_tp_engine
    return run_tp_engine(2, partial(make, tiny_dir, k, tp=2, **kw), tp_tokens_and_accepted, str(out),
                         kw.get("device", "cpu"), QWEN35_CACHE=cache_dir)


def test_tp2_matches_tp1(tiny_dir, cache_dir, tmp_path):
    got, accepted = run_tp2(tiny_dir, cache_dir, tmp_path / "tp2.pt")
    assert accepted > 0
    tp1, _ = run(make(tiny_dir, 2), tp_requests())
    assert got == {k: v[0] for k, v in tp1.items()}
    off, _ = run(make(tiny_dir, 0), tp_requests()[:2])
    assert got["g0"] == off["g0"][0] and got["g2"] == off["g2"][0]


@pytest.mark.gpu
def test_gpu_greedy_outputs_equal_speculation_off(tiny_dir, tmp_path):
    import json
    kw = dict(device="cuda", dtype="bfloat16", kernels="fast")
    reqs = [(f"g{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    off, _ = run(make(tiny_dir, 0, **kw), reqs)
    # auto by a table where a step costs the same whatever its k (the tiny model on a GPU: the fixed cost), so that
    # it speculates (the shipped tables are the full-size model's)
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"spec": [{"batch": b, "k": k, "step_ms": 1.0} for b in (1, 64) for k in range(4)]}))
    for k in (2, "auto"):
        eng = make(tiny_dir, k, **kw, **({"spec_cost_table": str(flat)} if k == "auto" else {}))
        on, _ = run(eng, reqs)
        assert on == off, k
        assert eng.stats()["spec_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_outputs_equal_speculation_off(tiny_dir, cache_dir, tmp_path):
    """TP=2 on two GPUs (NCCL, bf16, fast kernels, verify graphs with the shard passes): greedy and seeded sampled
    outputs with k = 2 equal those without speculation (the seeded row: exact in distribution only, so compared
    by length), and drafts were accepted (none without speculation)."""
    got = {}
    for k in (0, 2):
        got[k], accepted = run_tp2(tiny_dir, cache_dir, tmp_path / f"tp2_k{k}.pt", k, device="cuda",
                                   dtype="bfloat16", kernels="fast")
        assert accepted > 0 if k else accepted == 0
    for rid in ("g0", "g2"):
        assert got[2][rid] == got[0][rid], rid
    assert len(got[2]["seeded"]) == len(got[0]["seeded"]) == SEEDED.max_tokens


@pytest.mark.gpu
def test_gpu_verify_steps_queued_behind_never_wait(tiny_dir, monkeypatch):
    """On a GPU (bf16, fast kernels, verify graphs), every request admitted at once with k = 2: queueing a step, a
    verify step planned behind the runs of the one before included, never waits for the device (torch's sync debug
    mode turns any wait into an error); the outputs equal those without speculation."""
    kw = dict(device="cuda", dtype="bfloat16", kernels="fast", max_num_seqs=8)
    reqs = [(f"g{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    off, _ = run(make(tiny_dir, 0, **kw), reqs)
    eng = make(tiny_dir, 2, **kw)
    run(eng, [(f"warm{i}", p, SamplingParams(max_tokens=8, ignore_eos=True)) for i, p in enumerate(PROMPTS)])
    behind, launch = [], eng._launch

    def strict(b):
        behind.append(b)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(b)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(eng, "_launch", strict)
    on, _ = run(eng, reqs)
    assert on == off
    assert sum(behind) >= 4 and eng.stats()["spec_verify_graph_steps"] > 0, behind


def test_speculation_defaults_to_auto_on_gpus_where_the_model_has_its_head(tiny_dir, tmp_path):
    """--speculative-tokens not given (EngineArgs.resolve_speculation): auto on a GPU where the model has its MTP
    head (in its config, and in its checkpoint's `mtp.*` tensors or in the weights a dummy load format makes); 0 on
    the CPU, for a checkpoint without the head's tensors and for a model without a head; a value given is kept. It
    reads the config and the checkpoint's tensor names only, so a GPU's case runs here."""
    from safetensors.torch import save_file
    from qwen35.config import ModelConfig
    from qwen35.synth import PRESETS

    def resolved(config, model_dir, **kw):
        args = EngineArgs(model=model_dir or "preset", **kw)
        args.resolve_speculation(config, model_dir)
        return args.speculative_tokens

    tiny = ModelConfig.from_dir(tiny_dir)
    assert tiny.mtp_num_hidden_layers == 1
    assert resolved(tiny, tiny_dir, device="cuda:0") == "auto"
    assert resolved(tiny, tiny_dir, device="cpu") == 0
    for given in (0, 2, "auto"):
        assert resolved(tiny, tiny_dir, device="cuda:0", speculative_tokens=given) == given
    headless = tmp_path / "headless"
    headless.mkdir()
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(2, 2)}, str(headless / "model.safetensors"))
    assert resolved(tiny, str(headless), device="cuda:0") == 0
    flagship = ModelConfig.from_dict(dict(PRESETS["qwen3.5-35b-a3b"]))
    assert resolved(flagship, None, device="cuda:0", load_format="dummy") == "auto"
    dense = ModelConfig.from_dict(dict(PRESETS["tiny-llama"]))
    assert dense.mtp_num_hidden_layers == 0
    assert resolved(dense, None, device="cuda:0", load_format="dummy") == 0


def test_an_engine_on_the_cpu_does_not_speculate_unless_asked(tiny_dir):
    """The default on the CPU (the tiny checkpoint has its head): speculation off, no MTP head built."""
    eng = LLMEngine(EngineArgs(model=tiny_dir, device="cpu", dtype="float32", kernels="torch", max_num_seqs=2,
                               max_model_len=64, warm_up=False))
    assert eng.args.speculative_tokens == 0 and eng.speculation.setting == 0
    assert eng.runner.model.mtp is None and eng.runner.spec_max_k == 0
    eng.shutdown()


def test_a_cost_table_measured_at_start(tiny_dir, references, monkeypatch):
    """`--spec-cost-table measure` (on GPUs also wherever no table ships): before the first request, rows of every
    batch up to max_num_seqs and k = 0..AUTO_MAX_K (qwen35/spec_costs.py) become auto's table; the engine is then as
    it was: the setting auto, the running acceptance at its prior, no request, no KV block or slot held, the prefix
    cache empty; and its greedy outputs equal speculation off."""
    from qwen35 import spec_costs
    from scheduler.speculation import ACCEPTANCE_PRIOR, AUTO_MAX_K, CostTable
    monkeypatch.setattr(spec_costs, "START_INPUT_LEN", 12)  # (a CPU's worth: the rows' shape, not their times)
    monkeypatch.setattr(spec_costs, "START_OUTPUT_LEN", 6)
    eng = make(tiny_dir, "auto", spec_cost_table="measure", max_num_seqs=2)
    assert eng.measures_spec_costs and eng.speculation.table.source.startswith("placeholder")
    spec_costs.measure_at_start(eng)
    table = eng.speculation.table
    assert not eng.measures_spec_costs and table.source.startswith("measured at start")
    assert sorted(table.steps) == list(range(AUTO_MAX_K + 1))
    assert all([b for b, _ in table.steps[k]] == [1, 2] and all(ms > 0 for _, ms in table.steps[k])
               for k in table.steps)
    p = eng.speculation
    assert p.setting == "auto" and p.k is None and p.acceptance == ACCEPTANCE_PRIOR and p.drafted > 0
    stats = eng.stats()
    assert not eng.has_unfinished() and stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["prefix_cache_blocks"] == 0 and stats["prefix_cache_snapshots"] == 0
    expected = references["dummy-spec"]
    got, _ = run(eng, [r for r in requests(expected) if r[0].startswith(("m", "long"))])
    assert got == {rid: expected[rid] for rid in got}
    # a measured table is a table: the engine's own rows would load as one (CostTable.from_rows)
    assert isinstance(table, CostTable)


def test_no_cost_table_on_the_cpu_means_the_placeholder(tiny_dir, caplog):
    """auto with no table for the device and no measure asked for: on the CPU the placeholder, said in the log (on
    GPUs the server measures one at start)."""
    with caplog.at_level("WARNING"):
        eng = make(tiny_dir, "auto")
    assert not eng.measures_spec_costs and eng.speculation.table.source.startswith("placeholder")
    assert "no measured speculation cost table for cpu" in caplog.text and "placeholder" in caplog.text
