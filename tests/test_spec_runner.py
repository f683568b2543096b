"""The runner's speculative steps (qwen35/runner.py verify_step, draft buffers, plan.spec_k / plan.draft_k) on the
tiny model with a small vocabulary, fp32, CPU, torch kernels.

- greedy: the tokens of verify steps (k = 1, 2, 3) == plain decoding's, token for token, with the
  synthetic-acceptance weights (`dummy-spec`: greedy drafts are always accepted, so every step emits k + 1) and with
  random weights (`dummy`: drafts are almost always rejected, so every step rolls back); rows of different lengths
  in slots out of order.
- a row whose KV blocks end inside a verify step's draft positions accepts only the drafts that have blocks (runs
  of 4, 4, 4, then 1 at k = 3 with the always-accepted synthetic drafts), its tokens still plain decoding's, and the
  other rows' tokens unaffected (its writes past its blocks go to the scratch block).
- sampled (the synthetic weights made for acceptance 0.6, temperature 1; and with top-k 4, and top-p 0.7): the
  tokens emitted at completion positions 1..3 (verify steps of k = 2: accepted drafts, residual draws, bonus tokens)
  follow the distribution plain sampling gives: a two-sample chi-square test of homogeneity per position over
  SAMPLES sequences each (bins: tokens with an expected count of 5 or more in both samples, the rest pooled),
  p-value above ALPHA = 1e-3 (a correct sampler fails one position's test with probability 1e-3); the same test
  rejects the draft distribution itself (the drafts as emitted tokens) at one of those positions, so it has the
  power to see a wrong sampler; some drafts are accepted and some rejected.
- seeded: the same keys give the same tokens, run again on a fresh runner.
"""
import pytest
import torch
from scipy.stats import chi2_contingency

from layers.sampler import Sampler, SamplingStep
from qwen35.config import ModelConfig
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.test_mtp import small_vocab

VOCAB = 512
BLOCK = 16
SLOTS = [2, 0, 3]


def make_runner(load_format: str, k, acceptance: float = 0.7, seqs: int = 4, snapshots: int = 0) -> ModelRunner:
    cfg = ModelConfig.from_dict(small_vocab(VOCAB))
    args = EngineArgs(model="", load_format=load_format, spec_acceptance=acceptance, device="cpu", dtype="float32",
                      kernels="torch", block_size=BLOCK, max_num_seqs=seqs, max_model_len=256, mtp=True,
                      speculative_tokens=k, seed=1)
    runner = ModelRunner(cfg, args, num_snapshot_slots=snapshots)
    runner.attach_sampler(Sampler(VOCAB - 64, VOCAB, runner.scratch_slot + 1, "cpu"), host_ring=False)
    return runner


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 64, (L,), generator=gen).tolist() for L in (7, 19, 3)][:n]


def admit(runner, settings, keys=None):
    """The rows' sampling settings (temperature, top_k, top_p) into their slots, as the engine's admission does."""
    keys = keys or [100 + s for s in SLOTS]
    runner.sampler.admit(SamplingStep(admitted=[(s, tuple(p), key) for s, p, key in zip(SLOTS, settings, keys)]))


def prefill_plan(ps, draft_k):
    width = 256 // BLOCK
    return StepPlan([*SLOTS[:len(ps)]], [list(p) for p in ps], [0] * len(ps),
                    [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(len(ps))], [True] * len(ps),
                    draft_k=draft_k)


def decode_plan(starts, spec_k=0, draft_k=0):
    n = len(starts)
    return StepPlan([*SLOTS[:n]], [[] for _ in range(n)], list(starts), [[] for _ in range(n)], [True] * n,
                    spec_k=spec_k, draft_k=draft_k)


def plain_tokens(runner, ps, steps, step=SamplingStep()):
    out = [[t] for t in runner.sample_step(prefill_plan(ps, 0), step).tolist()]
    starts = [len(p) for p in ps]
    for _ in range(steps - 1):
        for o, t in zip(out, runner.sample_step(decode_plan(starts), step).tolist()):
            o.append(t)
        starts = [s + 1 for s in starts]
    return out


def spec_tokens(runner, ps, steps, k, step=SamplingStep()):
    """Verify steps of k drafts until every row has `steps` tokens; also the tokens emitted per step."""
    out = [[t] for t in runner.sample_step(prefill_plan(ps, k), step).tolist()]
    return verify_until(runner, out, [len(p) for p in ps], steps, k, step)


def verify_until(runner, out, starts, steps, k, step):
    """Verify steps of k drafts, rows at `starts` with tokens `out` so far, until every row has `steps` tokens:
    (the rows' tokens, the tokens emitted per step)."""
    per_step = []
    while min(map(len, out)) < steps:
        emitted = runner.sample_step(decode_plan(starts, k, k), step).tolist()
        per_step.append([sum(t >= 0 for t in row) for row in emitted])
        for i, row in enumerate(emitted):
            run = [t for t in row if t >= 0]
            out[i] += run
            starts[i] += len(run)
    return [o[:steps] for o in out], per_step


@pytest.mark.parametrize("load_format", ["dummy-spec", "dummy"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_verify_steps_give_plain_decoding_tokens(load_format, k):
    ps, steps = prompts(3), 12
    plain = make_runner(load_format, 0)
    admit(plain, [(0, 0, 1)] * 3)
    expected = plain_tokens(plain, ps, steps)
    spec = make_runner(load_format, k)
    admit(spec, [(0, 0, 1)] * 3)
    got, per_step = spec_tokens(spec, ps, steps, k)
    assert got == expected
    emitted = [n for row in per_step for n in row]
    if load_format == "dummy-spec":
        assert min(emitted) == k + 1  # greedy drafts of the synthetic weights are always right
    else:
        assert sum(emitted) / len(emitted) < 1.5  # random weights: nearly every draft rejected


def test_copied_states_take_their_pending_drafts_first():
    """After a verify step the DeltaNet states hold back the accepted drafts (runner.pending); a prefix-cache copy of
    a slot (a reply's snapshot) copies the state with them taken: the snapshot and the slot equal plain decoding's
    state after the same tokens (TOL: the verify step's attention against the decode attention, fp32), nothing is
    left pending, and the next verify step's tokens are still plain decoding's."""
    from types import SimpleNamespace
    ps, k = prompts(3), 2
    plain = make_runner("dummy-spec", 0)
    admit(plain, [(0, 0, 1)] * 3)
    expected = plain_tokens(plain, ps, 1 + k + 1)  # the prefill's token, then k + 1 decode steps (their inputs fed)
    spec = make_runner("dummy-spec", k, snapshots=1)
    admit(spec, [(0, 0, 1)] * 3)
    out = [[t] for t in spec.sample_step(prefill_plan(ps, k), SamplingStep()).tolist()]
    starts = [len(p) for p in ps]
    for _ in range(2):
        emitted = spec.sample_step(decode_plan(starts, k, k), SamplingStep()).tolist()
        assert [sum(t >= 0 for t in r) for r in emitted] == [k + 1] * 3  # (every draft accepted: k pending a slot)
        out = [o + r for o, r in zip(out, emitted)]
        starts = [s + k + 1 for s in starts]
        if len(out[0]) == 1 + k + 1:
            assert out == expected and spec.pending[SLOTS].tolist() == [k] * 3
            snap = spec.snapshot_slots[0]
            spec._apply_copies(SimpleNamespace(copy_states=[(SLOTS[0], snap)], copy_blocks=[]))
            assert spec.pending[[SLOTS[0], snap]].tolist() == [0, 0] and spec.pending[SLOTS[1:]].tolist() == [k, k]
            for m_spec, m_plain in zip(spec.gdn_layers, plain.gdn_layers):
                want = m_plain.ssm_state[SLOTS[0]]
                for got in (m_spec.ssm_state[snap], m_spec.ssm_state[SLOTS[0]]):
                    assert (got - want).abs().max().item() <= 1e-4
                assert (m_spec.conv_state[snap] - m_plain.conv_state[SLOTS[0]]).abs().max().item() <= 1e-4
                # (the other slots still hold theirs back)
                assert (m_spec.ssm_state[SLOTS[1]] - m_plain.ssm_state[SLOTS[1]]).abs().max().item() > 1e-3
    fresh = make_runner("dummy-spec", 0)
    admit(fresh, [(0, 0, 1)] * 3)
    assert out == plain_tokens(fresh, ps, 1 + 2 * (k + 1))


def test_a_row_at_the_end_of_its_blocks_accepts_fewer_drafts():
    ps, k = prompts(3), 3
    tables = [list(range(1, 9)), [20, 21], list(range(30, 38))]  # row 1: positions 0..31 only
    plain = make_runner("dummy-spec", 0)
    admit(plain, [(0, 0, 1)] * 3)
    expected = plain_tokens(plain, ps, 14)
    spec = make_runner("dummy-spec", k)
    admit(spec, [(0, 0, 1)] * 3)
    plan = StepPlan([*SLOTS], [list(p) for p in ps], [0] * 3, tables, [True] * 3, draft_k=k)
    out = [[t] for t in spec.sample_step(plan, SamplingStep()).tolist()]
    starts, runs = [len(p) for p in ps], []
    while starts[1] < 32:
        emitted = spec.sample_step(decode_plan(starts, k, k), SamplingStep()).tolist()
        for i, row in enumerate(emitted):
            run = [t for t in row if t >= 0]
            out[i] += run
            starts[i] += len(run)
        runs.append(sum(t >= 0 for t in emitted[1]))
    assert runs == [4, 4, 4, 1]
    assert [o[:14] for o in out] == expected


SAMPLES = 1536
ALPHA = 1e-3
BATCH = 64


def many_slots_runner(k):
    cfg = ModelConfig.from_dict(small_vocab(VOCAB))
    args = EngineArgs(model="", load_format="dummy-spec", spec_acceptance=0.6, device="cpu", dtype="float32",
                      kernels="torch", block_size=BLOCK, max_num_seqs=BATCH, max_model_len=32, num_kv_blocks=2 * BATCH,
                      mtp=True, speculative_tokens=k, seed=1)
    runner = ModelRunner(cfg, args)
    runner.attach_sampler(Sampler(VOCAB - 64, VOCAB, runner.scratch_slot + 1, "cpu"), host_ring=False)
    return runner


def sampled_positions(runner, k, setting, key0, positions=4):
    """SAMPLES sequences of one prompt, sampled with `setting` (temperature, top_k, top_p) and keys key0 + i:
    their first `positions` completion tokens [SAMPLES, positions], and per verify step the tokens emitted per
    row."""
    prompt = prompts(1, seed=4)[0]
    rows, emitted = [], []
    step = SamplingStep(greedy_only=False, any_top_k=setting[1] > 0, any_top_p=setting[2] < 1)
    for b in range(SAMPLES // BATCH):
        slots = list(range(BATCH))
        runner.sampler.admit(SamplingStep(admitted=[(s, setting, key0 + b * BATCH + s) for s in slots]))
        tables = [[2 * s, 2 * s + 1] for s in slots]
        plan = StepPlan(slots, [list(prompt)] * BATCH, [0] * BATCH, tables, [True] * BATCH, draft_k=k)
        out = [[t] for t in runner.sample_step(plan, step).tolist()]
        starts = [len(prompt)] * BATCH
        while min(map(len, out)) < positions:
            plan = StepPlan(slots, [[]] * BATCH, list(starts), [[]] * BATCH, [True] * BATCH, spec_k=k, draft_k=k)
            got = runner.sample_step(plan, step)
            got = got.tolist() if got.dim() == 2 else [[t] for t in got.tolist()]
            emitted.append([sum(t >= 0 for t in r) for r in got])
            for i, r in enumerate(got):
                run = [t for t in r if t >= 0]
                out[i] += run
                starts[i] += len(run)
        rows += [o[:positions] for o in out]
    return torch.tensor(rows), emitted


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that samples a and b (token ids) come from one distribution."""
    ids = torch.cat([a, b]).unique()
    counts = torch.stack([(a[:, None] == ids).sum(0), (b[:, None] == ids).sum(0)]).double()
    expected = counts.sum(0) * counts.sum(1, keepdim=True) / counts.sum()
    big = (expected >= 5).all(0)
    table = torch.cat([counts[:, big], counts[:, ~big].sum(1, keepdim=True)], dim=1)
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table.numpy(), correction=False)[1]


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.7)], ids=["t1", "topk4", "topp0.7"])
def test_sampled_tokens_follow_plain_sampling(setting):
    k = 2
    plain, _ = sampled_positions(many_slots_runner(0), 0, setting, key0=10_000)
    spec, emitted = sampled_positions(many_slots_runner(k), k, setting, key0=50_000)
    counts = torch.tensor(emitted).flatten()
    assert (counts == 1).any() and (counts == k + 1).any()  # rejections and fully accepted runs both happen
    for j in range(1, 4):
        p = homogeneity_p(plain[:, j], spec[:, j])
        assert p > ALPHA, (j, p)


def test_the_homogeneity_test_sees_the_draft_distribution():
    """Its power: the drafts themselves (drawn from the MTP head's q, not the target's p) as if emitted."""
    setting, k = (1.0, 0, 1.0), 2
    plain, _ = sampled_positions(many_slots_runner(0), 0, setting, key0=10_000)
    runner = many_slots_runner(k)
    prompt = prompts(1, seed=4)[0]
    drafts = []
    step = SamplingStep(greedy_only=False, any_top_k=False, any_top_p=False)
    for b in range(SAMPLES // BATCH):
        slots = list(range(BATCH))
        runner.sampler.admit(SamplingStep(admitted=[(s, setting, 90_000 + b * BATCH + s) for s in slots]))
        plan = StepPlan(slots, [list(prompt)] * BATCH, [0] * BATCH, [[2 * s, 2 * s + 1] for s in slots],
                        [True] * BATCH, draft_k=k)
        runner.sample_step(plan, step)
        drafts.append(runner.drafts[:BATCH, 0].clone())  # completion position 1's draft
    assert homogeneity_p(plain[:, 1], torch.cat(drafts)) < ALPHA


def test_seeded_sampling_is_reproducible():
    setting, k = (0.8, 0, 0.9), 2
    a, _ = sampled_positions(many_slots_runner(k), k, setting, key0=7)
    b, _ = sampled_positions(many_slots_runner(k), k, setting, key0=7)
    assert torch.equal(a, b)


def test_verify_warm_up_runs_every_variant_on_scratch_state_only():
    """The GPU's verify warm-up (runner._warm_up_verify: decode attention at every split variant a verify step's
    row counts meet, the sampling passes, the DeltaNet verify / commit), here with the fast kernels through the
    interpreter: it runs, leaves every running slot's state and every real KV block as they were, and the row counts
    it decodes cover each split variant once."""
    from layers.attention import decode_splits, decode_config, decode_variant_rows
    cfg = ModelConfig.from_dict(small_vocab(VOCAB))
    args = EngineArgs(model="", load_format="dummy-spec", device="cpu", dtype="float32", kernels="fast",
                      block_size=BLOCK, max_num_seqs=4, max_model_len=256, mtp=True, speculative_tokens=2, seed=1)
    runner = ModelRunner(cfg, args)
    live = list(range(runner.num_state_slots))  # (no sampler attached yet: the engine warms up first)
    for m in runner.gdn_layers:
        m.conv_state.normal_()
        m.ssm_state.normal_()
    before = ([m.conv_state[live].clone() for m in runner.gdn_layers], [m.ssm_state[live].clone() for m in
              runner.gdn_layers], [a.k_cache[:runner.num_kv_blocks].clone() for a in runner.attn_layers])
    runner._warm_up_verify(VOCAB - 64)
    after = ([m.conv_state[live] for m in runner.gdn_layers], [m.ssm_state[live] for m in runner.gdn_layers],
             [a.k_cache[:runner.num_kv_blocks] for a in runner.attn_layers])
    assert all(torch.equal(x, y) for b, a in zip(before, after) for x, y in zip(b, a))
    a = runner.attn_layers[0]
    width = runner.block_table.shape[1] * runner.block_size
    rows = decode_variant_rows(12, a.num_kv_heads, width, a.head_dim, runner.device)
    variants = set()
    for r in range(1, 13):
        cfg_d = decode_config(a.head_dim, r)
        s = decode_splits(r, a.num_kv_heads, width, runner.device, cfg_d["tile"], cfg_d["per_sm"])
        variants.add((tuple(sorted(cfg_d.items())), 1 << (s - 1).bit_length(), s == 1, s % 16 == 0))
    assert len(rows) == len(variants) >= 2


def head_entries(runner, cache: str, slot_index: int, positions) -> torch.Tensor:
    """The MTP head's cache entries of the sequence in SLOTS[slot_index] (its blocks as prefill_plan lays them out)."""
    pos = torch.as_tensor(positions)
    return getattr(runner.model.mtp.attn, cache)[1 + slot_index * (256 // BLOCK) + pos // BLOCK, pos % BLOCK]


def test_prompt_chunks_that_sample_nothing_write_the_heads_kv():
    """A prompt's body in a step of its own that samples nothing (the prefix cache's split leaves it so; draft_k 0)
    writes the MTP head's KV at its positions, as a prefill of the whole prompt that proposes does: every entry but
    the body's last, whose next token (the prompt's last) is not in the step."""
    ps = prompts(3)
    whole = make_runner("dummy-spec", 2)
    whole.sample_step(prefill_plan(ps, 2), SamplingStep())
    split = make_runner("dummy-spec", 2)
    body = prefill_plan([p[:-1] for p in ps], 0)
    body.want_logits = [False] * len(ps)
    assert split.sample_step(body, SamplingStep()) is None
    for cache in ("k_cache", "v_cache"):
        for i, p in enumerate(ps):
            got = head_entries(split, cache, i, range(len(p) - 2))  # entries whose next token is in the body
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, head_entries(whole, cache, i, range(len(p) - 2)), rtol=1e-5, atol=1e-5)


def test_plain_steps_write_the_heads_kv_as_proposing_steps_do():
    """Steps that propose nothing (auto at k = 0, a verify step whose successor drafts nothing) write the head's KV at
    their positions (qwen35/mtp.py write_kv: fc, the layer's input norm, the K/V projection), the entries a
    proposing step's catch-up writes there (the whole layer): greedy, the same tokens either way, so the same
    entries within fp32 tolerance. A verify step of draft_k 0 writes its accepted positions."""
    ps, steps = prompts(3), 5
    plain, proposing = make_runner("dummy-spec", 2), make_runner("dummy-spec", 2)
    out = {}
    for runner, k in ((plain, 0), (proposing, 1)):
        toks = [[t] for t in runner.sample_step(prefill_plan(ps, k), SamplingStep()).tolist()]
        starts = [len(p) for p in ps]
        for _ in range(steps):  # (proposing: each step proposes one draft, and none is verified)
            for o, t in zip(toks, runner.sample_step(decode_plan(starts, 0, k), SamplingStep()).tolist()):
                o.append(t)
            starts = [s + 1 for s in starts]
        out[k] = toks
    assert out[0] == out[1]
    for cache in ("k_cache", "v_cache"):
        for i, p in enumerate(ps):
            positions = range(len(p), len(p) + steps)  # the decode steps' positions (their next tokens known)
            got = head_entries(plain, cache, i, positions)
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, head_entries(proposing, cache, i, positions), rtol=1e-5, atol=1e-5)
    # a verify step whose successor drafts nothing: its accepted positions' entries, as the proposing one's
    verify_plain, verify_proposing = make_runner("dummy-spec", 2, acceptance=1.0), make_runner("dummy-spec", 2,
                                                                                              acceptance=1.0)
    emitted = {}
    for runner, k in ((verify_plain, 0), (verify_proposing, 1)):
        runner.sample_step(prefill_plan(ps, 1), SamplingStep())
        starts = [len(p) for p in ps]
        emitted[k] = runner.sample_step(decode_plan(starts, 1, k), SamplingStep())
    assert torch.equal(emitted[0], emitted[1])
    for cache in ("k_cache", "v_cache"):
        for i, p in enumerate(ps):
            accepted = int((emitted[0][i] >= 0).sum()) - 1
            positions = range(len(p), len(p) + accepted + 1)
            torch.testing.assert_close(head_entries(verify_plain, cache, i, positions),
                                       head_entries(verify_proposing, cache, i, positions), rtol=1e-5, atol=1e-5)
