"""The Triton kernels of speculative sampling on vocabulary shards (layers/spec_sampling.py), on the CPU through the
interpreter at tiny shapes, with P = 1, 2, 3 ranks simulated in one process (rank r holds its even shard of the
padded vocabulary; an all-gather stacks the ranks' messages in rank order):

- each kernel against its torch twin on the same inputs: the stats pass and the residual pass (their blocks merged
  in the kernel; the residual's rows read in place) against stats_torch / residual_torch of the same rows, and
  _accept_kernel, _last_token_kernel and _draw_kernel against the same arithmetic in torch on the same gathered
  parts (merge_stats / merge_residual over the ranks, then the acceptance as verify_sampled decides it);
- draft_fast / verify_fast themselves on every simulated rank against the gathered reference (draft_torch /
  verify_torch on whole rows): greedy, sampled and mixed batches, fewer drafts on some rows (none on one), k = 0,
  maxima tied across shard boundaries, -inf logits, padding inside the last shard and shards of padding only;
- every kernel variant compiles for sm_90 (tests/hopper_compile.py), and the runner's warm-up meets the compile
  keys of steps of any batch size, k and drafts per row (tests/triton_keys.py).
Token ids and counts are compared exactly; sums and log-sum-exps to float32 rounding.
"""
import dataclasses
import types

import pytest
import torch

from dist import parallel
from layers import spec_sampling as ss
from layers.linear import even_split
from layers.sampler import SampleBatch

pytest.importorskip("triton")

V = 2346       # padded vocabulary: 3 blocks per row at P = 1, 2 at P = 2 (shards of 1173), 1 at P = 3 (782)
REAL = V - 37  # padding inside the last shard
TIED = [700, 781, 782, 1172, 1173, 1563, 1564]  # ids across every shard boundary (782, 1173, 1564)


def shards(P: int, real: int = REAL) -> list[tuple[int, int, int]]:
    """(start, n, n_valid) of each rank's shard."""
    return [(start, n, max(0, min(real - start, n))) for start, n in (even_split(V, r, P) for r in range(P))]


def make_batch(temps, key0=11, counter0=5) -> SampleBatch:
    """Rows at temperatures `temps`; the temperature a column of a [B, 3] table, as the runner's (a strided view)."""
    B = len(temps)
    params = torch.zeros(B, 3)
    params[:, 0], params[:, 2] = torch.tensor(temps), 1.0
    return SampleBatch(params[:, 0], params[:, 1], params[:, 2], torch.arange(key0, key0 + B),
                       torch.arange(counter0, counter0 + B) * 3, None, False, False, False)


@dataclasses.dataclass
class Case:
    name: str
    target: torch.Tensor        # [B, k + 1, V]
    draft: torch.Tensor         # [B, k, V]
    batch: SampleBatch | None   # None: every row greedy
    num: torch.Tensor | None    # drafts per row (None: k)
    real: int = REAL
    drafts: torch.Tensor | None = None  # [B, k]: drawn by draft_torch unless set
    lse: torch.Tensor | None = None     # [B, k]


def draw_reference(c: Case) -> Case:
    """The drafts and their log-sum-exps as draft_torch draws them from whole rows (position j at counter + j)."""
    k = c.draft.shape[1]
    ds = [ss.draft_torch(c.draft[:, j], None if c.batch is None else
                         dataclasses.replace(c.batch, counter=c.batch.counter + j), c.real, V) for j in range(k)]
    drafts = torch.stack([d.tokens for d in ds], 1) if k else torch.zeros(c.target.shape[0], 0, dtype=torch.int64)
    lse = torch.stack([d.lse for d in ds], 1) if k else torch.zeros(c.target.shape[0], 0)
    return dataclasses.replace(c, drafts=drafts if c.drafts is None else c.drafts, lse=lse)


def cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)

    def logits(B, k, spread=3.0, near=0.3):
        target = torch.randn(B, k + 1, V, generator=g) * spread
        return target, target[:, :k] + torch.randn(B, k, V, generator=g) * near

    out = []
    t, d = logits(2, 3, 4.0)
    out.append(Case("greedy", t, d, None, None))
    t, d = logits(3, 3, 3.0, 0.2)
    out.append(Case("sampled_near", t, d, make_batch([1.0, 0.7, 1.3]), None))
    t, d = logits(2, 2, 3.0, 3.0)
    out.append(Case("sampled_far", t, d, make_batch([1.0, 0.9]), None))
    t, d = logits(4, 3, 2.0)
    out.append(Case("mixed_fewer", t, d, make_batch([0.0, 1.0, 0.0, 0.8]), torch.tensor([3, 1, 0, 2])))
    t, d = logits(2, 0)
    out.append(Case("k0", t, d, make_batch([1.0, 0.0]), None))
    # the row maxima tied across every shard boundary: the lowest id is the argmax; greedy drafts of the tie's
    # lowest id are accepted, of another tied id rejected
    t, d = logits(3, 2, 1.0)
    t[..., TIED] = t.amax(dim=-1, keepdim=True) + 2.0
    d[..., TIED] = d.amax(dim=-1, keepdim=True) + 2.0
    drafts = torch.tensor([[TIED[0], TIED[0]], [TIED[0], TIED[3]], [TIED[0], TIED[0]]])
    out.append(Case("ties", t, d, make_batch([0.0, 0.0, 1.0]), None, drafts=drafts))
    # -inf logits, and the real vocabulary inside the first shard at P = 2 and 3 (the others padding only)
    t, d = logits(2, 2, 2.0)
    t[..., 3::7] = float("-inf")
    d[..., 5::11] = float("-inf")
    out.append(Case("padding_and_minus_inf", t, d, make_batch([0.0, 1.0]), torch.tensor([1, 2]), real=700))
    return [draw_reference(c) for c in out]


# ----------------------------------------------------------------------------- the ranks, simulated
def on_ranks(P: int, fn, monkeypatch) -> list:
    """[fn() on rank r for r < P], as P ranks run it: parallel's rank and size patched, each all_gather answered
    with every rank's message stacked in rank order. The calls repeat, round by round, until every all-gather is
    answered (the i-th message depends on the answers before it only; unanswered ones get a stand-in)."""
    answers = []
    while True:
        sent, results = [], []
        for r in range(P):
            mine = []

            def all_gather(x, mine=mine):
                mine.append(x.clone())
                i = len(mine) - 1
                return answers[i].clone() if i < len(answers) else torch.ones(P, *x.shape, dtype=x.dtype)

            monkeypatch.setattr(parallel, "tp_rank", lambda r=r: r)
            monkeypatch.setattr(parallel, "tp_size", lambda: P)
            monkeypatch.setattr(parallel, "all_gather", all_gather)
            results.append(fn(r))
            sent.append(mine)
        if all(len(m) == len(answers) for m in sent):
            return results
        answers.append(torch.stack([m[len(answers)] for m in sent]))


def part(x: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return x[..., start:start + n].contiguous()


# ----------------------------------------------------------------------------- each kernel against its twin
def rows(batch: SampleBatch | None, B: int, T: int):
    """Per row b T + j: (inv_t, key, counter + j), as stats_torch takes them (batch None: 1, unused noise)."""
    if batch is None:
        one = torch.ones(B * T)
        return one, one.long(), one.long()
    r = ss.at_positions(batch, T)
    return r.inv_temperature, r.key, r.counter


@pytest.mark.parametrize("P", [1, 2, 3])
def test_stats_pass_equals_stats_torch(P):
    for c in cases():
        B, T, _ = c.target.shape
        k = T - 1
        for start, n, nv in shards(P, c.real):
            lg = part(c.target, start, n).view(B * T, n)
            inv_t, key, counter = rows(c.batch, B, T)
            accept = c.batch is not None
            want = ss.stats_torch(lg, nv, start, 0, inv_t, key, counter, False, accept)
            got = (ss.stats_fast(lg, nv, start, 0, c.batch, T, drafts=c.drafts,
                                 draft_logits=part(c.draft, start, n).view(B * k, n)) if accept
                   else ss.stats_fast(lg, nv, start, 0, None, T))
            assert got.shape == (B * T, ss.STATS + ss.DRAFT_X * accept)
            exact = [0, 1, 3, 4, 5]
            assert torch.equal(got[:, exact], want[:, exact]), (c.name, P, start)
            assert torch.allclose(got[:, 2], want[:, 2], rtol=1e-5), (c.name, P, start)
            if accept:  # x of each position's draft under p and q, on the shard that holds it
                local = c.drafts - start
                own = (local >= 0) & (local < nv)
                at = local.clamp(0, n - 1)[..., None]
                inv = c.batch.inv_temperature[:, None]
                for col, src in ((ss.STATS, part(c.target, start, n)[:, :k]), (ss.STATS + 1, part(c.draft, start, n))):
                    x = torch.where(own, src.gather(2, at)[..., 0] * inv + 0.0, float("-inf"))
                    x = torch.cat([x, torch.full((B, 1), float("-inf"))], 1).view(B * T)
                    assert torch.equal(got[:, col], x), (c.name, P, start, col)
        # a draft's pass: Gumbel scores with the draft stream's noise, one position per row
        if c.batch is not None and k:
            for start, n, nv in shards(P, c.real):
                lg = part(c.draft[:, 0], start, n)
                want = ss.stats_torch(lg, nv, start, ss.DRAFT_ID_OFFSET, c.batch.inv_temperature, c.batch.key,
                                      c.batch.counter, True)
                got = ss.stats_fast(lg, nv, start, ss.DRAFT_ID_OFFSET, c.batch, sampled=True)
                assert torch.equal(got[:, [0, 1, 3, 4, 5]], want[:, [0, 1, 3, 4, 5]]), (c.name, P)
                assert torch.allclose(got[:, 2], want[:, 2], rtol=1e-5), (c.name, P)


def accept_torch(parts, drafts, num, batch, draft_lse):
    """_accept_kernel's twin: the ranks' STATS [P, B * T, W] merged (merge_stats), the drafts accepted as
    verify_greedy / verify_sampled decide it -> (tokens with each row's argmax at `accepted`, emitted, lse there)."""
    B, k = drafts.shape
    T = k + 1
    st = ss.merge_stats(parts[..., :ss.STATS], dim=0).view(B, T, ss.STATS)
    target = st[..., 1].to(torch.int64)
    lse_p = st[..., 0] + st[..., 2].log()
    acc = ss._accepted(drafts == target[:, :k], drafts, num)
    if batch is not None:
        xp = parts[..., ss.STATS].amax(dim=0).view(B, T)[:, :k]
        xq = parts[..., ss.STATS + 1].amax(dim=0).view(B, T)[:, :k]
        u = torch.exp(-torch.exp(st[..., 5]))[:, :k]
        sampled = ss._accepted(u * torch.exp(xq - draft_lse) < torch.exp(xp - lse_p[:, :k]), drafts, num)
        acc = torch.where(batch.temperature > 0, sampled, acc)
    j = torch.arange(T)[None, :]
    tokens = torch.where(j < acc[:, None], torch.cat([drafts, drafts.new_zeros(B, 1)], 1), target)
    return tokens.masked_fill(j > acc[:, None], -1), acc + 1, lse_p.gather(1, acc[:, None])[:, 0]


def gathered_stats(c: Case, P: int) -> torch.Tensor:
    """The ranks' STATS (+ DRAFT_X) of the case's positions, stacked: what _accept_kernel receives."""
    B, T, _ = c.target.shape
    return torch.stack([ss.stats_fast(part(c.target, s, n).view(B * T, n), nv, s, 0, c.batch, T, drafts=c.drafts,
                                      draft_logits=part(c.draft, s, n).view(B * (T - 1), n))
                        if c.batch is not None else ss.stats_fast(part(c.target, s, n).view(B * T, n), nv, s, 0,
                                                                  None, T)
                        for s, n, nv in shards(P, c.real)])


@pytest.mark.parametrize("P", [1, 2, 3])
def test_accept_kernel_equals_its_torch_twin(P):
    seen = set()
    for c in cases():
        parts = gathered_stats(c, P)
        verdict, lse = ss._accept(parts, c.drafts, c.num, c.batch, c.lse if c.batch is not None else None)
        tokens, emitted, want_lse = accept_torch(parts, c.drafts, c.num, c.batch, c.lse)
        assert torch.equal(verdict.tokens, tokens), (c.name, P, verdict.tokens.tolist(), tokens.tolist())
        assert torch.equal(verdict.num_emitted, emitted), (c.name, P)
        if c.batch is not None:
            assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-6), (c.name, P)
        seen.update(emitted.tolist())
    assert len(seen) >= 3  # drafts accepted and rejected


@pytest.mark.parametrize("P", [1, 2, 3])
def test_residual_pass_and_last_token_equal_their_torch_twins(P):
    for c in cases():
        if c.batch is None:
            continue
        B, T, _ = c.target.shape
        k = T - 1
        i = torch.arange(B)
        emitted = (torch.arange(B) % T) + 1  # every position: rejected drafts and the bonus
        a = emitted - 1
        jq = a.clamp(max=max(k - 1, 0))
        lse_p = (c.target[i, a] * c.batch.inv_temperature[:, None])[:, :c.real].logsumexp(-1)
        inv_t = c.batch.inv_temperature
        res, want = [], []
        for s, n, nv in shards(P, c.real):
            p_rows = part(c.target, s, n)
            q_rows, lse_q = (part(c.draft, s, n)[i, jq], c.lse[i, jq]) if k else (p_rows[i, a], lse_p)
            want.append(ss.residual_torch(p_rows[i, a], q_rows, nv, s, inv_t, lse_p, lse_q, c.batch.key,
                                          c.batch.counter + a))
            res.append(ss.residual_fast(p_rows, part(c.draft, s, n), nv, s, c.batch, emitted, lse_p, c.lse))
            got = res[-1]
            assert torch.equal(got[:, [1, 4]], want[-1][:, [1, 4]]) and torch.equal(got[:, 3], want[-1][:, 3]), \
                (c.name, P, s)
            assert torch.allclose(got[:, [0, 2]], want[-1][:, [0, 2]], rtol=1e-4, atol=1e-6), (c.name, P, s)
        # the last token from the ranks' parts, written for the sampled rows only
        tokens = torch.full((B, T), 7, dtype=torch.int64)
        ss._last_token(torch.stack(res), ss.Verdict(tokens, emitted), c.num, c.batch)
        r = ss.merge_residual(torch.stack(want), dim=0)
        rejected = a < (k if c.num is None else c.num)
        last = torch.where(rejected & (r[:, 2] > 0), r[:, 1], r[:, 4]).to(torch.int64)
        sampled = c.batch.temperature > 0
        want_tokens = torch.full((B, T), 7, dtype=torch.int64)
        want_tokens[i[sampled], a[sampled]] = last[sampled]
        assert torch.equal(tokens, want_tokens), (c.name, P, tokens.tolist(), want_tokens.tolist())


@pytest.mark.parametrize("P", [1, 2, 3])
def test_draw_kernel_equals_its_torch_twin(P):
    for c in cases():
        if not c.draft.shape[1]:
            continue
        lg = c.draft[:, 0]
        batch = c.batch
        inv_t, key, counter = rows(batch, lg.shape[0], 1)
        parts = torch.stack([ss.stats_torch(part(lg, s, n), nv, s, ss.DRAFT_ID_OFFSET, inv_t, key, counter,
                                            batch is not None) for s, n, nv in shards(P, c.real)])
        got = ss._draw(parts, batch)
        st = ss.merge_stats(parts, dim=0)
        if batch is None:
            tokens, lse = st[:, 1], torch.zeros(lg.shape[0])
        else:
            sampled = batch.temperature > 0
            tokens, lse = torch.where(sampled, st[:, 4], st[:, 1]), torch.where(sampled, st[:, 0] + st[:, 2].log(), 0.)
        assert torch.equal(got.tokens, tokens.to(torch.int64)), (c.name, P)
        assert torch.allclose(got.lse, lse, rtol=1e-6, atol=1e-6), (c.name, P)


# ----------------------------------------------------------------------------- draft_fast / verify_fast on ranks
@pytest.mark.parametrize("P", [1, 2, 3])
def test_ranks_draw_and_verify_the_references_tokens(P, monkeypatch):
    seen = set()
    for c in cases():
        T = c.target.shape[1]
        want = ss.verify_torch(c.target, c.drafts, c.draft, c.lse, c.batch, c.num, c.real, V)
        starts = shards(P, c.real)

        def verify(r):
            s, n, _ = starts[r]
            return ss.verify_fast(part(c.target, s, n), c.drafts, part(c.draft, s, n), c.lse, c.batch, c.num,
                                  c.real, V)

        for got in on_ranks(P, verify, monkeypatch):
            assert torch.equal(got.tokens, want.tokens), (c.name, P, got.tokens.tolist(), want.tokens.tolist())
            assert torch.equal(got.num_emitted, want.num_emitted), (c.name, P)
        seen.update(want.num_emitted.tolist())
        if T > 1:  # the draft of position 0
            drawn = ss.draft_torch(c.draft[:, 0], c.batch, c.real, V)
            for got in on_ranks(P, lambda r: ss.draft_fast(part(c.draft[:, 0], *starts[r][:2]), c.batch, c.real, V),
                                monkeypatch):
                assert torch.equal(got.tokens, drawn.tokens), (c.name, P)
                assert torch.allclose(got.lse, drawn.lse, rtol=1e-5, atol=1e-5), (c.name, P)
    assert len(seen) >= 3


# ----------------------------------------------------------------------------- compiles and compile keys
def test_kernels_compile_for_hopper(monkeypatch):
    from tests.hopper_compile import compile_all, hopper_backend_available, recorded
    if not hopper_backend_available():
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    c = next(c for c in cases() if c.name == "mixed_fewer")
    with recorded() as launches:
        for P in (1, 3):
            starts = shards(P, c.real)
            for batch in (None, c.batch):
                on_ranks(P, lambda r: ss.verify_fast(part(c.target, *starts[r][:2]), c.drafts,
                                                     part(c.draft, *starts[r][:2]), c.lse, batch, c.num, c.real, V),
                         monkeypatch)
                on_ranks(P, lambda r: ss.draft_fast(part(c.draft[:, 0], *starts[r][:2]), batch, c.real, V),
                         monkeypatch)
    names = {e["name"] for e in launches}
    assert {"_stats_kernel", "_accept_kernel", "_residual_kernel", "_last_token_kernel", "_draw_kernel"} <= names
    assert compile_all(launches) == []


def test_warm_up_meets_the_keys_of_every_step():
    """The runner's warm-up (one row, k = 1, greedy and sampled) meets every compile key of verify and draft steps
    of other batch sizes, k, drafts per row and temperatures (the launches recorded, not run)."""
    from qwen35.runner import ModelRunner
    from tests.triton_keys import record, unmet
    fake = types.SimpleNamespace(model=types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=torch.zeros(V, 1))),
                                 device=torch.device("cpu"), config=types.SimpleNamespace(vocab_size=V),
                                 _draft=ss.draft_fast, _verify=ss.verify_fast)
    with record() as met:
        ModelRunner._warm_up_spec_sampling(fake, REAL)
    seen = []
    for B, k in ((1, 2), (2, 1), (3, 3), (5, 8), (16, 3), (32, 2)):
        num = torch.arange(B) % (k + 1)
        for temps in ([0.0] * B, [1.0] * B, [0.0, 0.7] * (B // 2) + [1.0] * (B % 2)):
            batch = make_batch(temps)
            batch = None if max(temps) == 0 else batch
            with record() as keys:
                d = ss.draft_fast(torch.zeros(B, V), batch, REAL, V)
                ss.verify_fast(torch.zeros(B, k + 1, V), torch.zeros(B, k, dtype=torch.int64),
                               torch.zeros(B, k, V), torch.zeros(B, k), batch, num if B % 2 else None, REAL, V)
            seen += [f"B {B} k {k} {u}" for u in unmet(keys, met)]
            assert d.tokens.shape == (B,)
    assert not seen, "\n".join(seen[:20])
