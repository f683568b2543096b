"""Verify steps through cuda_graphs.VerifyGraphs: the static-shape step a verify graph captures (rows padded to the
capture size on the scratch slot, whole block tables, device-only inputs: runner.verify_inputs / verify_forward).

CPU (tiny model, small vocabulary, fp32, torch kernels; VerifyGraphs(capture=False) queues the graphs' work
eagerly, with the host lists the torch kernels read):
- the padded static step gives the tokens of today's eager verify step, token for token, at k = 1, 2, 3: greedy
  with the synthetic-acceptance weights (drafts accepted) and random weights (drafts rejected), and sampled at
  temperature 1 with fixed keys; 3 rows padded to the capture size 4; its slots' draft buffers equal too.
- a step of padded rows only leaves every running slot's DeltaNet state and conv tail, every KV block but the
  scratch one (the MTP head's included), the block tables, the slots' drafts, distributions, next tokens and
  draw counters exactly as they were.
- a step that only proposes (spec_k 0, draft_k k: a verify step of none) gives the plain step's eager tokens and
  drafts, its rows fed from the device or a prompt's last token from the host; greedy and sampled.
- which verify steps a graph holds: draft_k == spec_k or spec_k 0, a sampling mode (not top-k / top-p), rows up to
  the largest size; and that the steady state is such steps: the scheduler's plans with K fixed (and min_tokens),
  and auto's k held while the acceptance wavers around a tie.
GPU (`gpu`): the captured graphs replayed == the eager verify step (greedy tokens identical; sampled, seeded,
identical), with rows padded (3 of 4) and at a full size; a step that only proposes replays its graph and matches
the same step queued eagerly; plain decode steps replayed from the decode graphs write the MTP head's KV as the
same steps queued eagerly do.
"""
import pytest
import torch

from layers.sampler import SamplingStep
from qwen35.cuda_graphs import VerifyGraphs
from scheduler.plan import StepPlan
from tests.test_spec_runner import (SLOTS, admit, decode_plan, head_entries, make_runner, plain_tokens, prefill_plan,
                                   prompts, spec_tokens, verify_until)

GREEDY = SamplingStep()
SAMPLED = SamplingStep(greedy_only=False, any_top_k=False, any_top_p=False)


def with_static_graphs(runner, capture=False):
    runner.verify_graphs = VerifyGraphs(runner, capture=capture)
    return runner


@pytest.mark.parametrize("load_format", ["dummy-spec", "dummy"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_static_padded_verify_gives_the_eager_tokens_greedy(load_format, k):
    ps, steps = prompts(3), 10
    eager = make_runner(load_format, k)
    admit(eager, [(0, 0, 1)] * 3)
    expected, per_step = spec_tokens(eager, ps, steps, k)
    static = with_static_graphs(make_runner(load_format, k))
    assert static.verify_graphs.sizes == [1, 2, 4]  # 3 rows run padded to 4
    admit(static, [(0, 0, 1)] * 3)
    got, got_per_step = spec_tokens(static, ps, steps, k)
    assert got == expected and got_per_step == per_step
    assert torch.equal(static.drafts[SLOTS], eager.drafts[SLOTS])
    if load_format == "dummy-spec":
        assert min(n for row in per_step for n in row) == k + 1


@pytest.mark.parametrize("k", [1, 3])
def test_static_padded_verify_gives_the_eager_tokens_sampled(k):
    ps, steps, keys = prompts(3), 10, [11, 12, 13]
    runs = []
    for runner in (make_runner("dummy-spec", k, acceptance=0.6),
                   with_static_graphs(make_runner("dummy-spec", k, acceptance=0.6))):
        admit(runner, [(1.0, 0, 1.0)] * 3, keys)
        runs.append(spec_tokens(runner, ps, steps, k, SAMPLED))
    (expected, per_step), (got, got_per_step) = runs
    assert got == expected and got_per_step == per_step
    emitted = [n for row in per_step for n in row]
    assert min(emitted) < k + 1  # some drafts rejected: the residual draws are compared too


def propose_then_verify(runner, ps, steps, k, step, last_from_host):
    """A prefill that proposes nothing, a step of decode rows that only proposes (spec_k 0, draft_k k), then verify
    steps: every row's tokens, the tokens emitted per step, and the drafts the proposing step left. last_from_host:
    the prefill stops before each prompt's last token, which the proposing step takes from the host (the prefix
    cache's split); otherwise its rows are fed from the device."""
    n = len(ps)
    if last_from_host:
        runner.sample_step(prefill_plan([p[:-1] for p in ps], 0), step)
        plan = StepPlan([*SLOTS[:n]], [[p[-1]] for p in ps], [len(p) - 1 for p in ps], [[] for _ in ps], [True] * n,
                        draft_k=k)
        out, starts = [[t] for t in runner.sample_step(plan, step).tolist()], [len(p) for p in ps]
    else:
        out = [[t] for t in runner.sample_step(prefill_plan(ps, 0), step).tolist()]
        starts = [len(p) for p in ps]
        for o, t in zip(out, runner.sample_step(decode_plan(starts, 0, k), step).tolist()):
            o.append(t)
        starts = [s + 1 for s in starts]
    drafts = runner.drafts[SLOTS[:n], :k].clone()
    return (*verify_until(runner, out, starts, steps, k, step), drafts)


@pytest.mark.parametrize("last_from_host", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("step", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_step_that_only_proposes_runs_as_a_verify_step_of_none(k, step, last_from_host):
    """The step that starts speculation (decode rows, no drafts yet) through the static graphs: a verify step of
    T = 1 (one token a row) gives the tokens and the drafts of the plain step's eager path, its rows fed from the
    device or (a prompt's last token) from the host."""
    ps, steps, keys = prompts(3), 10, [41, 42, 43]
    setting = (0.0, 0, 1.0) if step.greedy_only else (1.0, 0, 1.0)
    runs = []
    for runner in (make_runner("dummy-spec", k, acceptance=0.6),
                   with_static_graphs(make_runner("dummy-spec", k, acceptance=0.6))):
        admit(runner, [setting] * 3, keys)
        assert runner._proposes_only(decode_plan([5, 5, 5], 0, k), step) == (runner.verify_graphs is not None)
        runs.append(propose_then_verify(runner, ps, steps, k, step, last_from_host))
    (expected, per_step, drafts), (got, got_per_step, got_drafts) = runs
    assert got == expected and got_per_step == per_step
    assert torch.equal(got_drafts, drafts)
    assert max(n for row in per_step for n in row) > 1  # the drafts it proposed were accepted


def live_state(runner):
    """Everything a padded row must not touch: per running slot its DeltaNet caches, drafts, distributions, next
    token and draw counter; every KV block but the scratch one; the block tables."""
    live = list(range(runner.num_state_slots))
    out = {"tables": runner.block_table.clone(), "drafts": runner.drafts[live].clone(),
           "tokens": runner.slot_tokens[live].clone(), "draws": runner.sampler.draws[live].clone(),
           "logits": runner.draft_logits[live].clone(), "lse": runner.draft_lse[live].clone()}
    for i, m in enumerate(runner.gdn_layers):
        out[f"conv{i}"], out[f"ssm{i}"] = m.conv_state[live].clone(), m.ssm_state[live].clone()
    for i, m in enumerate(runner.attn_layers):  # (the MTP head's attention is one of them)
        out[f"k{i}"], out[f"v{i}"] = m.k_cache[:runner.num_kv_blocks].clone(), m.v_cache[:runner.num_kv_blocks].clone()
    return out


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_padded_rows_touch_scratch_state_only(mode):
    k = 2
    runner = with_static_graphs(make_runner("dummy-spec", k, acceptance=0.6))
    admit(runner, [(1.0, 0, 1.0)] * 3, [21, 22, 23])
    runner.sample_step(prefill_plan(prompts(3), k), SAMPLED)  # live slots with state, KV, drafts and their q
    assert any(m.k_cache.abs().sum() > 0 for m in runner.attn_layers)
    before = live_state(runner)
    scratch = runner.scratch_slot
    graphs = runner.verify_graphs
    kv_before = runner.attn_layers[0].k_cache[runner.num_kv_blocks].clone()
    b = graphs.sizes[-1]
    with torch.inference_mode():
        tokens = graphs._step(b, k, k, mode, dict(start_pos_cpu=[0] * b, state_slots_cpu=[scratch] * b))
    assert tokens.shape == (b, k + 1)
    assert not torch.equal(runner.attn_layers[0].k_cache[runner.num_kv_blocks], kv_before)  # it ran, on scratch
    after = live_state(runner)
    for name, t in before.items():
        assert torch.equal(after[name], t), name


def test_which_verify_steps_a_graph_holds():
    runner = with_static_graphs(make_runner("dummy-spec", 2, seqs=4))
    holds = runner.verify_graphs.holds
    assert holds(decode_plan([5, 5, 5], 2, 2), GREEDY) and holds(decode_plan([5, 5, 5], 1, 1), SAMPLED)
    assert not holds(decode_plan([5, 5, 5], 2, 1), GREEDY)  # another draft_k: eager
    assert not holds(decode_plan([5, 5, 5], 2, 0), GREEDY)
    assert holds(decode_plan([5, 5, 5], 0, 2), GREEDY)  # a step of rows fed from the device that only proposes
    assert not holds(decode_plan([5, 5, 5], 0, 3), GREEDY)  # more drafts than the runner holds
    assert not holds(decode_plan([5, 5, 5], 2, 2), SamplingStep(greedy_only=False, any_top_k=True))
    assert not holds(decode_plan([5, 5, 5], 2, 2), SamplingStep(greedy_only=False, any_top_p=True))
    five = StepPlan([0, 1, 2, 3, 4], [[]] * 5, [5] * 5, [[]] * 5, [True] * 5, spec_k=2, draft_k=2)
    assert not holds(five, GREEDY)  # more rows than the largest size (max_num_seqs 4)


# ------------------------------------------------------------------- steady state: what the scheduler plans
class NoText:
    def add(self, token_id):
        return ""

    def flush(self):
        return ""


def planned(policy, params, steps=40):
    """The plans of a scheduler with `policy` serving 3 requests (prompts of 5 tokens, `params`), every verify step
    accepting every draft."""
    from qwen35.sampling_params import SamplingParams
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler
    s = Scheduler(num_kv_blocks=64, block_size=4, num_state_slots=4, max_num_seqs=4, max_num_batched_tokens=64,
                  speculation=policy)
    for i in range(3):
        s.add(Request(f"r{i}", list(range(10 * i, 10 * i + 5)), SamplingParams(**params), detokenizer=NoText()))
    plans = []
    for _ in range(steps):
        step = s.schedule()
        if not step.plan.num_seqs:
            break
        plans.append(step.plan)
        s.update(step.sampled, [[7] * (step.plan.spec_k + 1) for _ in step.sampled])
    return plans


def test_steady_state_verify_steps_propose_what_they_verify():
    """With K fixed every pure-decode step after the prefill verifies K and proposes K (a verify graph holds it);
    while min_tokens suppresses stop ids, the plain steps propose nothing (a decode graph holds them) except the
    last one, whose drafts the step after it verifies."""
    from scheduler.speculation import SpecPolicy
    plans = planned(SpecPolicy(2), dict(max_tokens=30))
    assert plans[0].draft_k == 2 and not plans[0].is_pure_decode
    assert len(plans) > 5 and all(p.is_pure_decode and p.spec_k == p.draft_k == 2 for p in plans[1:])
    plans = planned(SpecPolicy(2), dict(max_tokens=30, min_tokens=6))
    plain_proposing = [i for i, p in enumerate(plans) if p.is_pure_decode and not p.spec_k and p.draft_k]
    assert len(plain_proposing) == 1
    i = plain_proposing[0]
    assert all(p.draft_k == 0 for p in plans[1:i]) and i > 1
    assert all(p.spec_k == p.draft_k == 2 for p in plans[i + 1:]) and len(plans) > i + 3


def test_auto_keeps_its_k_while_the_acceptance_wavers():
    """Acceptance moving around the point where k = 1 and k = 2 cost the same (batch 8, shipped table: ~0.56): auto
    keeps one k (a verify graph replays only a step that proposes what it verifies), and still moves to the other
    once it is clearly cheaper."""
    from scheduler.speculation import CostTable, SpecPolicy
    p = SpecPolicy("auto", CostTable.placeholder())
    ks = []
    for i in range(40):
        p.assume(0.55 if i % 2 else 0.57)
        ks.append(p.next_k(8))
    assert len(set(ks)) == 1 and ks[0] in (1, 2)
    p.assume(0.9 if ks[0] == 1 else 0.42)
    assert p.next_k(8) == (3 if ks[0] == 1 else 1)


# ------------------------------------------------------------------------------------------------------- GPU
def gpu_runner(k, seqs):
    from layers.sampler import Sampler
    from qwen35.config import ModelConfig
    from qwen35.engine_config import EngineArgs
    from qwen35.runner import ModelRunner
    from tests.test_mtp import small_vocab
    from tests.test_spec_runner import VOCAB, BLOCK
    cfg = ModelConfig.from_dict(small_vocab(VOCAB))
    args = EngineArgs(model="", load_format="dummy-spec", spec_acceptance=0.6, device="cuda", dtype="bfloat16",
                      kernels="fast", block_size=BLOCK, max_num_seqs=seqs, max_model_len=256, mtp=True,
                      speculative_tokens=k, seed=1)
    runner = ModelRunner(cfg, args)
    runner.attach_sampler(Sampler(VOCAB - 64, VOCAB, runner.scratch_slot + 1, "cuda"), host_ring=False)
    return runner


@pytest.mark.gpu
@pytest.mark.parametrize("step", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_gpu_graph_replay_equals_eager_verify(step):
    k, ps, steps = 2, prompts(3), 16
    graphed = gpu_runner(k, seqs=4)
    assert graphed.verify_graphs is not None and graphed.verify_graphs.captured
    assert len(graphed.verify_graphs.graphs) == 3 * k * 2 * 2  # sizes 1, 2, 4; k 1, 2 verified or none; modes
    eager = gpu_runner(k, seqs=4)
    eager.verify_graphs = None
    runs = []
    for runner in (eager, graphed):
        admit(runner, [(0.0, 0, 1.0) if step.greedy_only else (1.0, 0, 1.0)] * 3, [31, 32, 33])
        runs.append(spec_tokens(runner, ps, steps, k, step))
    assert runs[1] == runs[0]
    assert max(n for row in runs[0][1] for n in row) > 1  # drafts accepted



@pytest.mark.gpu
@pytest.mark.parametrize("last_from_host", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("step", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_gpu_a_step_that_only_proposes_replays_a_graph(step, last_from_host):
    """The step that only proposes replays a verify graph of none and gives the tokens of the same step queued
    eagerly (greedy identical; sampled, seeded, identical), then the verify steps after it too."""
    k, ps, steps = 2, prompts(3), 16
    graphed, eager = gpu_runner(k, seqs=4), gpu_runner(k, seqs=4)
    assert (4, 0, k, "sampled") in graphed.verify_graphs.graphs
    eager.verify_graphs = VerifyGraphs(eager, capture=False)
    runs = []
    for runner in (eager, graphed):
        admit(runner, [(0.0, 0, 1.0) if step.greedy_only else (1.0, 0, 1.0)] * 3, [51, 52, 53])
        runs.append(propose_then_verify(runner, ps, steps, k, step, last_from_host)[:2])
    assert runs[1] == runs[0]
    assert max(n for row in runs[0][1] for n in row) > 1  # drafts accepted


@pytest.mark.gpu
def test_gpu_plain_steps_write_the_heads_kv_from_the_graph_tails():
    """Plain decode steps of an engine that speculates, replayed from the decode graphs (the head's KV written in
    their sampling tails, DecodeGraphs.write_head_kv), leave the head's cache entries of the same steps queued
    eagerly (bf16; greedy, the same tokens)."""
    ps, steps = prompts(3), 6
    graphed, eager = gpu_runner(2, seqs=4), gpu_runner(2, seqs=4)
    assert graphed.graphs is not None and graphed.graphs.tails
    eager.graphs = None
    out = []
    for runner in (eager, graphed):
        admit(runner, [(0.0, 0, 1.0)] * 3, [61, 62, 63])
        out.append(plain_tokens(runner, ps, steps))
    assert out[0] == out[1]
    for cache in ("k_cache", "v_cache"):
        for i, p in enumerate(ps):
            positions = range(len(p), len(p) + steps - 1)  # the decode steps' (their next tokens known)
            want = head_entries(eager, cache, i, positions).float()
            assert want.abs().sum() > 0
            torch.testing.assert_close(head_entries(graphed, cache, i, positions).float(), want, rtol=2e-2,
                                       atol=2e-2)
