"""The batched decode paths (DeltaNet step, CUDA-graph replay; paged attention is in tests/test_kernels_attention.py,
the MoE kernels in tests/test_kernels_moe.py) against the per-sequence reference paths they replace.

CPU, fp32: every fast path equals its reference to 1e-5 max abs (rounding only), on random inputs, random state
slots and random, shuffled, partly garbage block tables.

GPU (`-m gpu`; tests/test_gpu.py holds the basic ones: Triton kernels, graph vs eager at fixed slots): graph
replay vs eager decode with a batch that changes every step (sequences leave and come back, random slots, padded sizes 3, 5, 6). Tolerances:
- fp32 dense model, graph vs eager <= 1e-3: the same kernels on the same values; only GEMM row counts differ
  (padding), which changes fp32 rounding (~1e-6) and nothing else. Any slot/table/padding mistake is O(0.1).
- bf16 MoE, <= 3e-2 on logits up to ~3: 1e-3 is below one bf16 ulp of such logits (2^-7..2^-6), so it could only pass
  bit for bit; padded GEMMs round differently, and 20 steps of recurrent state carry that on. 3e-2 is 2-4 ulps,
  still ~10x under what a wrong slot or a leaking pad row does.
"""
import contextlib
import dataclasses
import math

import pytest
import torch
import torch.multiprocessing as mp

from qwen35.config import ModelConfig
from qwen35 import cuda_graphs
from qwen35.cuda_graphs import decode_batch, pad_row
from qwen35.engine_config import EngineArgs
from qwen35.runner import ModelRunner
from scheduler.plan import StepPlan
from tests.compare import max_diff
from tests.hf_reference import build_hf_model, caches, free_port, from_same_caches, join_ranks

TOL = 1e-5
BLOCK = 16
MAX_SEQS = 8
MAX_LEN = 256


# ------------------------------------------------------------------------------------------------ whole model
def decode_schedule(seed: int, num_seqs: int = 6, steps: int = 20, num_blocks: int = 128):
    """A prefill of num_seqs prompts in random slots and scattered blocks, then `steps` decode plans, each a random
    subset of the sequences in random order, of sizes cycling through 1..num_seqs (so padded graph sizes too)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(MAX_SEQS, generator=gen)[:num_seqs].tolist()
    prompts = [torch.randint(0, 1024, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (num_seqs,), generator=gen)]
    per_seq = math.ceil((40 + steps) / BLOCK)
    pool = torch.randperm(num_blocks, generator=gen)[: num_seqs * per_seq].tolist()
    tables = [pool[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]

    def table(i, length):
        return tables[i][: math.ceil(length / BLOCK)]

    pos = [len(p) for p in prompts]
    prefill = StepPlan(slots, prompts, [0] * num_seqs, [table(i, pos[i]) for i in range(num_seqs)], [True] * num_seqs)
    decodes = []
    for step in range(steps):
        who = torch.randperm(num_seqs, generator=gen)[: 1 + (step * 5) % num_seqs].tolist()
        tokens = torch.randint(0, 1024, (len(who),), generator=gen).tolist()
        decodes.append(StepPlan([slots[i] for i in who], [[t] for t in tokens], [pos[i] for i in who],
                                [table(i, pos[i] + 1) for i in who], [True] * len(who)))
        for i in who:
            pos[i] += 1
    return prefill, decodes


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fast-moe"))
    build_hf_model("moe", seed=3).save_pretrained(path)
    return path


def make_runner(path, **kw):
    return ModelRunner(ModelConfig.from_dir(path), EngineArgs(model=path, block_size=BLOCK, max_num_seqs=MAX_SEQS,
                                                              max_model_len=MAX_LEN, **kw), path)


def model_logits(runner, batch, fast: bool) -> torch.Tensor:
    """Logits of every row through the decode fast paths or the references."""
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        if fast:
            assert batch.is_decode
        else:
            batch = dataclasses.replace(batch, is_decode=False)
            for m in runner.gdn_layers:  # DeltaNet: the per-sequence reference, whichever kernel set built it
                patch.setattr(m, "_mixed", m.mixed_torch)
        return runner.model.compute_logits(runner.model(batch))


def test_model_decode_steps_fast_equal_reference(moe_dir):
    """20 decode steps of a changing batch: each through the fast paths and through the references from the same
    caches; logits and every cache entry agree. The next step starts from the reference's caches."""
    runner = make_runner(moe_dir, device="cpu", dtype="float32")
    prefill, decodes = decode_schedule(seed=1)
    runner.execute(prefill)
    for plan in decodes:
        batch = runner.prepare(plan)
        fast, after_fast, ref = from_same_caches(runner, lambda: model_logits(runner, batch, fast=True),
                                                 lambda: model_logits(runner, batch, fast=False))
        assert ref.abs().max() > 0.1
        assert max_diff(fast, ref) <= TOL
        for a, b in zip(after_fast, caches(runner)):
            assert max_diff(a, b) <= TOL


def graph_rows(plan: StepPlan, b: int, runner) -> torch.Tensor:
    """The decode graphs' rows [3, b] for a pure-decode plan, padded to b with pad_row (qwen35/cuda_graphs.py)."""
    rows = list(zip(plan.state_slots, plan.start_pos, [t[0] if t else -1 for t in plan.token_ids]))
    return torch.tensor(rows + [pad_row(runner)] * (b - plan.num_seqs), dtype=torch.int64).T.contiguous()


def test_graph_rows_make_prepares_batch_and_pads_touch_only_scratch(moe_dir):
    """What the decode graphs compute from their rows (decode_batch) is what runner.prepare gives the same step
    (block tables: the same entries, then the rest of each slot's row); and what makes padded replays safe, checked
    on the CPU: the 3 rows padded to 8 give the real rows the logits of the 3 alone and write the same real cache
    entries; pad rows write scratch only."""
    runner = make_runner(moe_dir, device="cpu", dtype="float32")
    prefill, decodes = decode_schedule(seed=2)
    runner.execute(prefill)
    plan = next(p for p in decodes if p.num_seqs == 3)
    batch = runner.prepare(plan)
    mine = decode_batch(runner, *graph_rows(plan, 3, runner))
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "state_slots"):
        assert torch.equal(getattr(mine, name), getattr(batch, name)), name
    width = batch.block_tables.shape[1]
    assert torch.equal(mine.block_tables[:, :width], batch.block_tables)
    padded = decode_batch(runner, *graph_rows(plan, MAX_SEQS, runner))
    alone, after_alone, with_pads = from_same_caches(
        runner, lambda: model_logits(runner, batch, fast=True), lambda: model_logits(runner, padded, fast=True))
    assert max_diff(with_pads[:3], alone) <= TOL
    for a, b in zip(after_alone, caches(runner)):  # scratch is the last slot / block of every cache
        assert max_diff(a[:-1], b[:-1]) <= TOL


# ------------------------------------------------------------------------------------------------------- GPU
def run_schedule(runner, seed: int) -> list[torch.Tensor]:
    prefill, decodes = decode_schedule(seed)
    runner.execute(prefill)
    return [runner.execute(p) for p in decodes]


def test_captures_run_with_the_collector_paused_after_a_collection():
    """Graph captures (cuda_graphs.collector_paused) run after a full collection, with the cyclic collector off:
    a collection mid-capture may destroy a dead engine's graphs, which invalidates the capture under way (seen on
    the GPU: a runner built after others were dropped). The collector is back on afterwards, also after an error."""
    import gc
    import weakref

    class Cycle:
        pass

    seen = []

    @cuda_graphs.collector_paused()
    def capture():
        seen.append((gc.isenabled(), ref() is None))
        raise RuntimeError("capture failed")

    dead = Cycle()
    dead.self = dead  # only a collection frees it
    ref = weakref.ref(dead)
    del dead
    assert gc.isenabled() and ref() is not None
    with pytest.raises(RuntimeError, match="capture failed"):
        capture()
    assert seen == [(False, True)]
    assert gc.isenabled()


GAP_SIZES = (1, 2, 4, 8)


@contextlib.contextmanager
def gap_sizes():
    """Runners built inside capture decode graphs at GAP_SIZES only: these hold at most MAX_SEQS rows, where
    capture_sizes has every size, and the tests want steps that run padded (as past 32 rows)."""
    real = cuda_graphs.capture_sizes
    cuda_graphs.capture_sizes = lambda rows: sorted({b for b in GAP_SIZES if b <= rows} | {rows})
    try:
        yield
    finally:
        cuda_graphs.capture_sizes = real


def graph_vs_eager(path, dtype) -> float:
    """Max |logit difference| between an eager runner and a CUDA-graph runner over the same decode schedule."""
    eager = make_runner(path, device="cuda", dtype=dtype, enforce_eager=True)
    with gap_sizes():
        graphs = make_runner(path, device="cuda", dtype=dtype)
    assert eager.graphs is None and graphs.graphs is not None
    assert sorted(graphs.graphs.graphs) == list(GAP_SIZES)
    return max(max_diff(a, b) for a, b in zip(run_schedule(eager, 4), run_schedule(graphs, 4)))


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_changing_batch_bf16(moe_dir):
    assert graph_vs_eager(moe_dir, "bfloat16") <= 3e-2


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager_changing_batch_fp32_dense(tmp_path):
    build_hf_model("dense", seed=5).save_pretrained(str(tmp_path))
    assert graph_vs_eager(str(tmp_path), "float32") <= 1e-3


def _tp_graph_worker(rank, world, port, path, out_file):
    from dist import parallel
    join_ranks(rank, world, port, "cuda")
    eager = run_schedule(make_runner(path, device="cuda", dtype="bfloat16", enforce_eager=True), 4)
    with gap_sizes():
        runner = make_runner(path, device="cuda", dtype="bfloat16")
    graphs = run_schedule(runner, 4)  # the all-reduces captured
    if rank == 0:
        torch.save([max_diff(a, b) for a, b in zip(eager, graphs)], out_file)
    parallel.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_graph_decode_equals_eager_tp2(moe_dir, tmp_path):
    out_file = str(tmp_path / "diffs.pt")
    mp.start_processes(_tp_graph_worker, args=(2, free_port(), moe_dir, out_file), nprocs=2, join=True,
                       start_method="spawn")
    assert max(torch.load(out_file)) <= 3e-2


def tail_vs_eager(path: str) -> list[str]:
    """A decode step's tail graph (3 rows run by the graph of 4), in both modes, against eager sampling from the
    same hidden rows at the same row count; every rank (at TP > 1 the tail's sampling exchanges candidates). The
    mismatches found, by name; the host ring is rank 0's."""
    from layers.sampler import Sampler, SamplingStep
    from dist import parallel
    with gap_sizes():
        runner = make_runner(path, device="cuda", dtype="bfloat16")
    vocab = runner.config.vocab_size
    sampler = Sampler(vocab, vocab, runner.scratch_slot + 1, "cuda")
    driver = parallel.is_driver()
    runner.attach_sampler(sampler, host_ring=driver)
    bad = []
    if set(runner.graphs.tails) != {(b, m, h) for b in GAP_SIZES for m in ("greedy", "sampled") for h in (0, 1)}:
        bad.append("tails")
    prefill, decodes = decode_schedule(7)
    runner.execute(prefill)
    plans = [p for p in decodes if p.num_seqs == 3][:2]
    sampler.admit(SamplingStep(False, False, False, [(s, (0.9, 0.0, 1.0), 100 + s) for s in plans[1].state_slots]))
    for plan, mode, half in zip(plans, ("greedy", "sampled"), (0, 1)):
        with torch.inference_mode():
            if runner._forward(plan)[1] is not None or runner.graphs.size != 4:
                bad.append(f"{mode}: not the graph of 4")
            draws = sampler.draws.clone()
            tokens = runner.graphs.run_tail(3, mode, half if driver else None)
            torch.cuda.synchronize()
            ring = runner.host_ring[half][:3].tolist() if driver else None
            inputs = runner.slot_tokens[plan.state_slots].tolist()
            tail_draws = sampler.draws.clone()
            sampler.draws.copy_(draws)
            logits = runner.model.compute_logits(runner.graphs.graphs[4][1], gather="none")
            want = sampler.sample(logits, runner.graphs.rows[0, :4], SamplingStep(greedy_only=mode == "greedy"))
            want = want[:3].tolist()
        if tokens.tolist() != want or inputs != want or (driver and ring != want):
            bad.append(f"{mode}: tokens {tokens.tolist()} ring {ring} inputs {inputs}, eager {want}")
        if not torch.equal(tail_draws, sampler.draws) or (tail_draws - draws)[plan.state_slots].tolist() != [1] * 3:
            bad.append(f"{mode}: draw counters")
    return bad


@pytest.mark.gpu
def test_sampling_tail_graph_equals_eager_sampling(moe_dir):
    """The tail graph gives, in both modes, the tokens eager sampling gives from the same hidden rows, bit for bit;
    it feeds them to the slots' inputs and into its host ring half, and moves the sampled slots' draw counters on by
    one, as eager sampling does."""
    assert tail_vs_eager(moe_dir) == []


def _tp_tail_worker(rank, world, port, path, out_file):
    from dist import parallel
    join_ranks(rank, world, port, "cuda", hang_s=240)
    bad = tail_vs_eager(path)
    torch.save(bad, f"{out_file}.{rank}")
    parallel.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sampling_tail_graph_equals_eager_sampling_tp2(moe_dir, tmp_path):
    """The same at TP=2: the tails' sampling exchanges candidates between the ranks inside the graph."""
    out_file = str(tmp_path / "bad")
    mp.start_processes(_tp_tail_worker, args=(2, free_port(), moe_dir, out_file), nprocs=2, join=True,
                       start_method="spawn")
    assert torch.load(f"{out_file}.0") == [] and torch.load(f"{out_file}.1") == []


@pytest.mark.parametrize("kernels", ["torch", "fast"])
def test_a_pad_sequence_changes_nothing_else(kernels):
    """A mixed step (two decode rows, one new prompt) run alone and with one more prompt sequence on a spare state
    slot and KV block, wanting no logits: the real rows' logits and the real slots' DeltaNet states, conv tails and
    KV blocks are equal (1e-5; fp32, tiny MoE model), while the pad sequence's own state moved. This is how a step
    padded to a captured token bucket would carry its padding (docs/admission_graphs.md: there on the scratch slot):
    no kernel sees it as anything but one more sequence."""
    from qwen35.synth import PRESETS
    runner = ModelRunner(ModelConfig.from_dict(PRESETS["tiny"]),
                         EngineArgs(model="tiny", load_format="dummy", device="cpu", dtype="float32", kernels=kernels,
                                    max_num_seqs=4, max_model_len=128))
    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(1, 1000, (n,), generator=gen).tolist()  # noqa: E731
    runner.execute(StepPlan([0, 1], [ids(20), ids(9)], [0, 0], [[0, 1], [2, 3]], [True, True]))
    step = StepPlan([0, 1, 2], [ids(1), ids(1), ids(12)], [20, 9, 0], [[], [], [4]], [True, True, True])
    pad_slot, pad_block = 3, 5
    padded = dataclasses.replace(step, state_slots=step.state_slots + [pad_slot], token_ids=step.token_ids + [ids(7)],
                                 start_pos=step.start_pos + [0], block_tables=step.block_tables + [[pad_block]],
                                 want_logits=step.want_logits + [False])
    caches = [t for m in runner.gdn_layers for t in (m.conv_state, m.ssm_state)] + \
        [t for m in runner.attn_layers for t in (m.k_cache, m.v_cache)]
    before = [t.clone() for t in caches]
    want = runner.execute(step)
    after = [t.clone() for t in caches]
    for t, b in zip(caches, before):
        t.copy_(b)
    got = runner.execute(padded)
    assert want.shape == got.shape == (3, runner.config.vocab_size) and max_diff(got, want) <= TOL
    states = 2 * len(runner.gdn_layers)
    for i, (t, a) in enumerate(zip(caches, after)):
        rows = [0, 1, 2] if i < states else [0, 1, 2, 3, 4]
        assert max_diff(t[rows], a[rows]) <= TOL, i
    assert max_diff(caches[1][pad_slot], before[1][pad_slot]) > 0  # the pad sequence did run
