"""ModelRunner: one rank's model shard, its caches, and the forward of one StepPlan.

Every rank holds one. The caches are allocated once, at fixed addresses: per full-attention layer a paged KV cache
[blocks, block_size, kv_heads, head_dim]; per DeltaNet layer a conv tail [slots, conv_dim, kernel-1] and an fp32
recurrent state [slots, v_heads, dk, dv]. A StepPlan addresses them by state slot only: per slot, the runner keeps
on the device the slot's KV block table (set by the plans that change it) and the token last sampled for it
(sample_step feeds it), which a row without tokens feeds. Preparing a step is one host-to-device copy of the plan's
integers (from pinned memory, asynchronous: the host never waits for the device) and a few device ops, so the host
can queue step N+1 while the device still runs step N. `execute` returns a step's logits (the logits-level API,
benchmarks, tests); `sample_step` is the engine's step: forward, sampling and the tokens fed back, on every rank.

Speculative decoding (plan.spec_k, plan.draft_k; scheduler/speculation.py): per slot the runner also keeps the drafts
proposed for it at the end of the step before ([slots, K] int64) and, for sampled rows, what they were drawn from: this
rank's vocabulary shard of the head's logits ([slots, K, vocab / tp] float32, made when first needed) and their
log-sum-exp ([slots, K]). A verify step (spec_k > 0, every row a decode row) feeds each row its newest token and its
spec_k drafts, takes this rank's shard of the logits at every position, accepts (layers/spec_sampling.py: greedy, or
rejection sampling at the rows' draw numbers; vocab-parallel with the fast kernels), moves the DeltaNet conv tails on
and leaves the accepted drafts pending for the states' next step (`pending`, layers/deltanet_verify.py), feeds each
slot its last emitted token and moves its draw counter on by the tokens emitted, and keeps per slot the drafts it
accepted (`accepted`: a verify step planned before the host has read them, plan.spec_behind, starts that much past
the host's positions). Any step with draft_k > 0 then proposes draft_k drafts for the rows it sampled
(qwen35/mtp.py propose) into the slots' buffers; any other step of a runner with the head writes the head's KV at
its positions (qwen35/mtp.py write_kv), so that drafts attend to every position before them. All of it queued on
every rank, no host sync. With CUDA graphs, a verify step that proposes as many drafts as it verifies (the steady
state) replays a graph of the whole step (cuda_graphs.VerifyGraphs), and so does a pure-decode step that proposes
without verifying (a verify step of none, one token a row: a prompt's last token, which the prefix cache's split
makes a decode row, or auto's k back from 0); other verify steps, and other steps that propose (prefill chunks), run
eagerly.
"""
from __future__ import annotations

import itertools
import logging
import math
import zlib
from itertools import repeat
from operator import add, le, mul

import torch

from dist import parallel, push
from layers import backend, deltanet
from layers.attention import GatedAttention, decode_variant_rows
from layers.block_tables import bind_set_tables, pack_tables
from layers.deltanet import GatedDeltaNet
from layers.deltanet_prefill import CHUNK
from layers.forward_batch import ForwardBatch
from layers.moe import SparseMoE, token_buckets
from layers.sampler import SampleBatch, bind_feed_tokens, feed_tokens_fast
from layers.spec_sampling import bind_spec_sampling
from layers.verify_rows import bind_verify_rows
from layers.varlen import SEQ_TILE
from qwen35.checkpoint import load_checkpoint
from qwen35.config import ModelConfig
from qwen35.cuda_graphs import RING_HALVES, decode_batch, tail_mode
from qwen35.engine_config import EngineArgs, EngineConfig
from qwen35.model import Qwen35Model
from qwen35.prefill_graphs import packed_tokens
from qwen35.mtp import attach_mtp, next_ids, propose, write_kv
from qwen35.synth_spec import init_spec_weights
from scheduler.plan import StepPlan, can_checkpoint

log = logging.getLogger("qwen35.runner")


def push_slots(config: ModelConfig) -> int:
    """Boundaries a forward pushes at most (dist/push.py): after every mixer and every feed-forward."""
    return 2 * config.num_hidden_layers


def push_rows(max_num_seqs: int, spec_max_k: int) -> int:
    """Rows of the steps whose boundaries push (dist/push.py): a decode step's, one a sequence, and a verify step's,
    k + 1 a sequence (past push.MAX_ROWS, steps all-reduce). At 128 rows (batch 64, k = 1) a verify step's 80
    boundaries had gone by the two-shot all-reduce and a norm kernel each: 0.96 ms of a 12.0 ms step at TP=2
    (2x H200, 2026-11-30)."""
    return min(push.MAX_ROWS, max_num_seqs * (spec_max_k + 1))


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights made on the device (no disk), by the same rule as the synthetic checkpoints.

    Replicated parameters get a seed from their name alone, so every rank holds the same values (the router must
    route identically everywhere); sharded ones also mix in the rank. A tied LM head is the embedding."""
    from qwen35.synth import init_tensor_
    cfg = model.config
    for name, p in model.named_parameters():
        sharded = tuple(p.shape) != p.full_shape
        key = f"{seed}:{name}:{parallel.tp_rank() if sharded else 'all'}"
        gen = torch.Generator(device=p.device)
        gen.manual_seed(zlib.crc32(key.encode()))
        init_tensor_(name, p.data, gen, zero_centred_norms=cfg.zero_centred_norms)
    if cfg.tie_word_embeddings:  # the same vocab rows on every rank (layers/embedding.py)
        model.lm_head.weight.data.copy_(model.embed_tokens.weight.data)


class ModelRunner:
    def __init__(self, config: ModelConfig, args: EngineArgs, model_dir: str | None = None,
                 num_snapshot_slots: int = 0):
        """`args`: the engine's settings (what the runner reads of them: load_format, dtype, device, block_size,
        max_num_seqs, max_model_len, gpu_memory_utilization, num_kv_blocks, enforce_eager, seed, kernels, mtp,
        spec_acceptance); `model_dir`: the checkpoint directory args.model resolved to (None with a dummy
        load_format); `num_snapshot_slots`: DeltaNet state slots to keep for the prefix cache's snapshots."""
        self.config = config
        self.engine_config = EngineConfig.resolve(config, args.device, args.dtype, args.max_model_len)
        self.device, self.dtype = self.engine_config.device, self.engine_config.dtype
        self.max_model_len = self.engine_config.max_model_len
        self.block_size = args.block_size
        self.max_num_seqs = args.max_num_seqs
        self.num_snapshot_slots = num_snapshot_slots
        self.enforce_eager = args.enforce_eager
        config.check_tp(parallel.tp_size())
        # the kernel set is chosen once, here: the layers bind their implementations as they are built
        self.kernels = backend.resolve(args.kernels, self.device)
        backend.set_kernels(self.kernels)
        self._feed_tokens = bind_feed_tokens()
        self._set_tables_dev = bind_set_tables()
        torch.manual_seed(args.seed)
        self.model = Qwen35Model(config, dtype=self.dtype, device=self.device, max_positions=self.max_model_len)
        if args.builds_mtp:  # the MTP head: loaded and initialised with the rest, its KV cache allocated with the
            # others
            attach_mtp(self.model)
        self.spec_max_k = args.spec_max_k  # the draft buffers' width (0: no speculation)
        if args.random_weights:
            init_dummy_weights(self.model, args.seed)
            if args.load_format == "dummy-spec":
                init_spec_weights(self.model, args.spec_acceptance, args.seed)
        elif args.load_format == "safetensors":
            if model_dir is None:
                raise ValueError("load_format 'safetensors' needs a model directory")
            load_checkpoint(self.model, model_dir, self.device, progress=parallel.is_driver())
        else:
            raise ValueError(f"unknown load_format {args.load_format!r} (use 'safetensors', 'dummy' or 'dummy-spec')")
        self.model.eval()
        if self.device.type == "cuda" and self.kernels == "fast":
            # small all-reduces over peer buffers (dist/allreduce.py), set up before the KV budget is measured
            elt = torch.empty((), dtype=self.dtype).element_size()
            if parallel.setup_symmetric_all_reduce(self.max_num_seqs * config.hidden_size * elt, self.device):
                parallel.setup_push(push_slots(config), push_rows(self.max_num_seqs, self.spec_max_k),
                                    config.hidden_size, self.dtype, self.device)
        self._allocate_caches(args.gpu_memory_utilization, args.num_kv_blocks)
        self._allocate_slot_inputs()
        self.graphs = None
        self.prefill_graphs = None  # dense models' prefill steps (qwen35/prefill_graphs.py): create_engine's warm-up
        self.verify_graphs = None  # attach_sampler (with the sampler: the graphs sample)
        self.verify_counts = {"graph": 0, "eager": 0}  # verify steps replayed from a graph / queued eagerly
        if self.device.type == "cuda" and not self.enforce_eager:
            if not all(getattr(m, "sync_free", True) for m in self.model.modules()):
                # the torch experts loop over the experts a batch hits, a host sync a CUDA graph cannot hold
                log.warning("no CUDA graphs: kernels %r wait for the host (use --kernels fast)", self.kernels)
            else:
                from qwen35.cuda_graphs import DecodeGraphs
                self.graphs = DecodeGraphs(self)
        self.sampler, self.host_ring, self._host_views = None, None, {}  # attach_sampler

    # ---------------------------------------------------------------- caches
    def _allocate_caches(self, utilization: float, num_kv_blocks: int | None) -> None:
        self.attn_layers = attn = [m for m in self.model.modules() if isinstance(m, GatedAttention)]
        self.gdn_layers = gdn = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        # state slots: one per running sequence, then the prefix cache's snapshots, then one scratch slot (and one
        # scratch KV block) that padded rows of captured graphs read and write
        slots = self.max_num_seqs + self.num_snapshot_slots + 1
        for m in gdn:
            m.conv_state = torch.zeros(slots, m.conv_dim, m.kernel - 1, dtype=self.dtype, device=self.device)
            m.ssm_state = torch.zeros(slots, m.num_v_heads, m.dk, m.dv, dtype=torch.float32, device=self.device)
        # with speculation, per slot the accepted drafts its states have not taken yet (layers/deltanet_verify.py)
        self.pending = deltanet.allocate_replay(gdn, slots, self.spec_max_k, self.dtype, self.device) \
            if self.spec_max_k else None
        self.num_state_slots = self.max_num_seqs
        self.snapshot_slots = list(range(self.max_num_seqs, self.max_num_seqs + self.num_snapshot_slots))
        self.scratch_slot = slots - 1
        elt = torch.empty((), dtype=self.dtype).element_size()
        per_block = sum(2 * self.block_size * m.num_kv_heads * m.head_dim * elt for m in attn)
        # more than every slot filled to max_model_len is not worth reserving (the prefix cache keeps in blocks only
        # what admission does not need)
        useful = self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        if num_kv_blocks is None:
            num_kv_blocks = useful
            if self.device.type == "cuda" and per_block:
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - (1 - utilization) * total
                num_kv_blocks = min(useful, int(budget // per_block))
        num_kv_blocks = parallel.all_reduce_min_int(num_kv_blocks)
        if num_kv_blocks < math.ceil(self.max_model_len / self.block_size):
            raise RuntimeError(f"only {num_kv_blocks} KV blocks fit: not even one sequence of max_model_len "
                               f"{self.max_model_len}; lower --max-model-len or raise --gpu-memory-utilization")
        for m in attn:
            shape = (num_kv_blocks + 1, self.block_size, m.num_kv_heads, m.head_dim)
            m.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            m.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_kv_blocks = num_kv_blocks
        if parallel.is_driver():
            per_slot = sum(m.conv_state[0].nbytes + m.ssm_state[0].nbytes + (m.replay[0].nbytes if m.replay is not None
                                                                               else 0) for m in gdn)
            log.info("caches: %d KV blocks of %d tokens (%.1f MiB), %d DeltaNet state slots + %d prefix-cache "
                     "snapshots (%.1f MiB each)", num_kv_blocks, self.block_size, num_kv_blocks * per_block / 2**20,
                     self.num_state_slots, self.num_snapshot_slots, per_slot / 2**20)

    def _allocate_slot_inputs(self) -> None:
        """Per state slot, on the device: its KV block table and the token last sampled for it."""
        slots = self.scratch_slot + 1
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        # with speculation, spare columns of the scratch KV block past every table: a verify row's draft positions
        # past its blocks read there (prepare_verify); a row planned a verify step behind may start up to K past the
        # host's last position
        spare = -(-(2 * self.spec_max_k + 1) // self.block_size) + 1 if self.spec_max_k else 0
        self.block_table = torch.zeros(slots, self.max_blocks_per_seq + spare, dtype=torch.int32, device=self.device)
        self.block_table[:, self.max_blocks_per_seq:] = self.num_kv_blocks
        self.block_table[self.scratch_slot] = self.num_kv_blocks  # padded graph rows: the scratch KV block only
        self.slot_tokens = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self._table_len = [0] * slots  # blocks set per slot, on the host: plans are checked against it
        # a host tensor copied to the device asynchronously must stay untouched until the copy has run: pinned
        # memory from torch's caching host allocator is not handed out again before then
        self._pin = self.device.type == "cuda"
        self.logit_slots = torch.zeros(0, dtype=torch.int64, device=self.device)  # of the last step's logits rows
        # speculation (module docstring): the drafts per slot, what they were drawn from (sampled rows: made when
        # first needed: vocab / tp x 4 B per draft, ~1 MB at TP=1 at full size), and per slot the last position
        # its block table covers (draft positions are clamped to it) and the drafts it accepted at its last verify step
        # (one more row: the scratch slot's, which padded rows of verify graphs read and write: draft_rows)
        self.drafts = torch.zeros(self.num_state_slots + 1, self.spec_max_k, dtype=torch.int64, device=self.device) \
            if self.spec_max_k else None
        self.draft_logits: torch.Tensor | None = None  # [rows, K, vocab / tp] float32
        self.draft_lse: torch.Tensor | None = None     # [rows, K] float32
        self._draft, self._verify = bind_spec_sampling()
        self._verify_rows = bind_verify_rows()
        self.slot_end = torch.zeros(slots, dtype=torch.int64, device=self.device) if self.spec_max_k else None
        self.accepted = torch.zeros(slots, dtype=torch.int64, device=self.device) if self.spec_max_k else None

    # ---------------------------------------------------------------- forward
    def _set_tables(self, plan: StepPlan) -> None:
        """Write the block tables the plan sets into the slots' rows: one host-to-device copy of a flat array
        (layers/block_tables.py: ~0.1 ms for 64 tables of 65 blocks, where a [slot, column, block] triple per entry
        took ~4 ms on the host) and one launch that writes the rows."""
        sets = [(slot, t) for slot, t in zip(plan.state_slots, plan.block_tables) if t]
        if not sets:
            return
        for slot, t in sets:
            if not (0 <= slot < self.num_state_slots and len(t) <= self.max_blocks_per_seq
                    and 0 <= min(t) and max(t) < self.num_kv_blocks):
                raise ValueError(f"bad step plan: block table of {len(t)} blocks (ids {min(t)}..{max(t)}) for slot "
                                 f"{slot}; {self.num_kv_blocks} blocks, at most {self.max_blocks_per_seq} per slot")
            self._table_len[slot] = len(t)
        flat = pack_tables(sets)
        host = torch.empty(len(flat), dtype=torch.int64, pin_memory=self._pin)
        host.copy_(torch.frombuffer(flat, dtype=torch.int64))
        self._set_tables_dev(self.block_table, host.to(self.device, non_blocking=True), len(sets), self.slot_end,
                             self.block_size, self.max_model_len)

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """The step's inputs on the device (the block tables the plan sets are written first)."""
        if not plan.num_seqs:
            raise ValueError("bad step plan: no rows")
        self._set_tables(plan)
        bs = self.block_size
        slots, starts, lens = plan.state_slots, plan.start_pos, plan.seq_lens
        ctx = list(map(add, starts, lens))
        self._check_rows(slots, starts, lens, ctx)
        self._check_checkpoints(plan)
        cu = [0, *itertools.accumulate(lens)]
        want = [i for i, w in enumerate(plan.want_logits) if w]
        decode = plan.is_pure_decode
        from_device = [not t for t in plan.token_ids]
        fields = [slots, starts, ctx, cu, [cu[i + 1] - 1 for i in want], [slots[i] for i in want],
                  [t for ids in plan.token_ids for t in (ids or (-1,))], [v for c in plan.checkpoints for v in c]]
        # each field 16-byte aligned (an even number of int64s before it): kernels that take one compile once
        sizes = [len(f) for f in fields]
        padded = backend.aligned_sizes(sizes, torch.int64)
        flat = []
        for f, n in zip(fields, padded):
            flat += f
            flat += [0] * (n - len(f))
        host = torch.tensor(flat, dtype=torch.int64, pin_memory=self._pin)
        parts = host.to(self.device, non_blocking=True).split(padded)
        slots_d, starts_d, ctx_d, cu_d, logits_idx, self.logit_slots, tokens, checkpoints = (
            part[:n] for part, n in zip(parts, sizes))
        host = dict(cu_seqlens=cu_d.to(torch.int32), start_pos=starts_d.to(torch.int32), logits_indices=logits_idx,
                    seq_lens_cpu=lens, start_pos_cpu=list(starts), state_slots_cpu=list(slots))
        # the rows' block tables cut to the batch's context; a decode step where decode graphs run takes the slots'
        # whole tables (None) as the graphs do: the decode attention's split count goes by the table width, so cut
        # tables made a kernel variant per power of two of it, compiled mid-serving by the eager decode steps (those
        # that propose drafts: 3 compiles in a minute of serving, 1x H200, 2026-11-29)
        tables = None if decode and self.graphs is not None else self.block_table[slots_d, :-(-max(ctx) // bs)]
        if decode:  # (one token per row: a row without tokens feeds one)
            return decode_batch(self, slots_d, starts_d, None if all(from_device) else tokens, tables, **host)
        # per token its row and position, made on the device (torch's CPU ops took ~20 ms at 8 x 1024 tokens)
        seq_of_token, positions, slot_mapping = packed_tokens(cu_d, starts_d, tables, cu[-1], bs)
        input_ids = torch.where(tokens < 0, self.slot_tokens[slots_d[seq_of_token]], tokens) if any(from_device) \
            else tokens
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            context_lens=ctx_d.to(torch.int32),
            block_tables=tables,
            state_slots=slots_d,
            is_decode=False,
            checkpoints=checkpoints.view(-1, 3) if plan.checkpoints else None,
            checkpoints_cpu=list(plan.checkpoints),
            **host,
        )

    def _check_rows(self, slots: list[int], starts: list[int], lens: list[int], ctx: list[int]) -> None:
        """Each row's slot is a state slot and its context (start + tokens) inside the slot's block table: C-level
        passes, then the first bad row named."""
        table_len, bs = self._table_len, self.block_size
        if slots and 0 <= min(slots) and max(slots) < self.num_state_slots and \
                all(map(le, ctx, map(mul, map(table_len.__getitem__, slots), repeat(bs)))):
            return
        for i, (slot, c) in enumerate(zip(slots, ctx)):
            if not 0 <= slot < self.num_state_slots or c > table_len[slot] * bs:
                raise ValueError(f"bad step plan for row {i}: {lens[i]} tokens at {starts[i]} in slot {slot}, whose "
                                 f"block table holds {table_len[slot] if 0 <= slot < len(table_len) else 0}"
                                 f" blocks of {bs}")

    def _check_checkpoints(self, plan: StepPlan) -> None:
        """Each checkpoint names a row that runs the prefill kernels (not one token on a state), a position those
        can stop at (a chunk multiple from the row's start, or its end), once, and a snapshot slot no other
        checkpoint of the plan writes (two writes of one launch land in no defined order)."""
        lens, seen = plan.seq_lens, set()
        for row, pos, dst in plan.checkpoints:
            ok = (0 <= row < plan.num_seqs and self.max_num_seqs <= dst < self.scratch_slot
                  and not {(row, pos), dst} & seen and can_checkpoint(plan.start_pos[row], lens[row], pos, CHUNK))
            if not ok:
                raise ValueError(f"bad step plan: checkpoint (row {row}, position {pos}, slot {dst}) is not a chunk "
                                 f"boundary or the end of a prefill row of {plan.num_seqs}, or not a snapshot slot "
                                 f"[{self.max_num_seqs}, {self.scratch_slot}), or a position or slot given twice")
            seen |= {(row, pos), dst}

    def _apply_copies(self, plan: StepPlan) -> None:
        """Prefix-cache copies, with the effect of running them in plan order (a snapshot may be taken and read in
        the same plan), in as few waves of one gather + one scatter per cache tensor as that order allows. With
        speculation the states copied take their pending drafts first (a reply's snapshot after a verify step), so
        no copy has any pending."""
        if self.pending is not None and plan.copy_states:
            sources = sorted({src for src, _ in plan.copy_states if 0 <= src < self.scratch_slot})
            deltanet.settle(self.gdn_layers, torch.tensor(sources, dtype=torch.int64, pin_memory=self._pin).to(
                self.device, non_blocking=True))
        states = [t for m in self.gdn_layers for t in (m.conv_state, m.ssm_state)]
        for pairs, limit, tensors in ((plan.copy_states, self.scratch_slot,
                                       states + ([self.pending] if self.pending is not None else [])),
                                      (plan.copy_blocks, self.num_kv_blocks,
                                       [t for m in self.attn_layers for t in (m.k_cache, m.v_cache)])):
            if any(not (0 <= i < limit) for pair in pairs for i in pair):
                raise ValueError(f"bad step plan: a prefix-cache copy outside [0, {limit}): {pairs}")
            for wave in _copy_waves(pairs):
                if not tensors:
                    break
                index = torch.tensor(wave, dtype=torch.int64, pin_memory=self._pin).to(self.device, non_blocking=True)
                src, dst = index[:, 0], index[:, 1]
                for t in tensors:
                    t.index_copy_(0, dst, t.index_select(0, src))

    def _forward(self, plan: StepPlan, eager: bool = False) -> tuple[torch.Tensor, ForwardBatch | None]:
        """Queue the step's copies and forward: final-norm hidden states, and the step's batch (None: a CUDA graph
        ran it, from its rows alone, and every row wants logits: the hidden states are theirs)."""
        self._apply_copies(plan)
        graphs = self.graphs
        n = plan.num_seqs
        if not eager and graphs is not None and 0 < n <= graphs.max_size and not plan.checkpoints \
                and not plan.draft_k and plan.is_pure_decode and all(plan.want_logits):
            # a pure-decode step: its rows go to the graph as they are (it computes what prepare would)
            self._set_tables(plan)
            slots, starts, toks = plan.state_slots, plan.start_pos, plan.token_ids
            self._check_rows(slots, starts, [1] * n, [p + 1 for p in starts])
            tokens = None if not any(toks) else [t[0] if t else -1 for t in toks]
            hidden = graphs.run(slots, starts, tokens)
            self.logit_slots = graphs.rows[0, :n]
            return hidden, None
        held = self.prefill_graphs.rows_for(plan.state_slots, plan.start_pos, plan.token_ids) \
            if not eager and self.prefill_graphs is not None and not plan.is_pure_decode and not plan.checkpoints \
            and not plan.draft_k and all(plan.want_logits) and all(plan.token_ids) else None
        if held is not None:  # a prefill step of a dense model (qwen35/prefill_graphs.py)
            self._set_tables(plan)
            slots, starts, lens = plan.state_slots, plan.start_pos, plan.seq_lens
            self._check_rows(slots, starts, lens, list(map(add, starts, lens)))
            hidden = self.prefill_graphs.run(*held, lens)
            self.logit_slots = self.prefill_graphs.rows[:n]
            return hidden, None
        batch = self.prepare(plan)
        return self.model(batch), batch

    @torch.inference_mode()
    def execute(self, plan: StepPlan, gather: str = "driver", eager: bool = False) -> torch.Tensor | None:
        """Queue one step on the device; logits [n_want_logits, vocab] float32 on rank 0 (gather "driver"), on every
        rank ("all"), or each rank's vocabulary slice [n_want_logits, vocab / tp] ("none").
        `eager` skips the CUDA graphs (kernel counts)."""
        hidden, batch = self._forward(plan, eager)
        return self.model.compute_logits(hidden if batch is None else hidden[batch.logits_indices], gather=gather)

    def attach_sampler(self, sampler, host_ring: bool) -> None:
        """Every rank, once: the engine's sampler (layers/sampler.py Sampler), and on rank 0 (`host_ring`, CUDA) the
        pinned ring the step's tokens reach the host through: two halves, step k's tokens in half k % 2 (with
        overlap the host reads one step's while the device writes the next one's). With CUDA graphs, the
        sampling tails of every graph size are captured here (cuda_graphs.DecodeGraphs.capture_tails), and with
        speculation the verify graphs (cuda_graphs.VerifyGraphs)."""
        if sampler.params.shape[0] <= self.scratch_slot:  # padded graph rows sample the scratch slot
            raise ValueError(f"the sampler holds {sampler.params.shape[0]} slots; the runner names "
                             f"{self.scratch_slot + 1} (its scratch slot included)")
        self.sampler = sampler
        width = self.max_num_seqs * (self.spec_max_k + 1)  # (a verify step's tokens: spec_k + 1 a row)
        self.host_ring = [torch.empty(width, dtype=torch.int64, pin_memory=True)
                          for _ in range(RING_HALVES)] if host_ring else None
        self._host_views: dict[tuple[int, int], torch.Tensor] = {}
        if self.graphs is not None:
            self.graphs.capture_tails(sampler.sample, self._feed_tokens, self.host_ring)
            if self.spec_max_k:
                from qwen35.cuda_graphs import VerifyGraphs
                self.verify_graphs = VerifyGraphs(self, pool=self.graphs.pool)

    def host_view(self, half: int, n: int, T: int = 0) -> torch.Tensor:
        """Rank 0: the first n entries of host_ring[half], where a step's n tokens land; a verify step's [n, T] (one
        view per shape, kept)."""
        view = self._host_views.get((half, n, T))
        if view is None:
            view = self._host_views[half, n, T] = self.host_ring[half][:n * T].view(n, T) if T \
                else self.host_ring[half][:n]
        return view

    @torch.inference_mode()
    def sample_step(self, plan: StepPlan, sampling, half: int | None = None) -> torch.Tensor | None:
        """Every rank, the engine's step (after attach_sampler): the forward, sampling from this rank's vocabulary
        slice (collective; `sampling` a SamplingStep), and the tokens ([n] int64 on the device, the same on every
        rank) fed to their slots' next inputs and, on rank 0, into host_ring[half][:n]. A pure-decode step that a
        graph runs, with sampling a tail holds (cuda_graphs.tail_mode), is two replays. Queued, no host sync.
        A verify step (plan.spec_k) returns [n, spec_k + 1] instead: each row's emitted tokens, then -1
        (verify_step), into host_view(half, n, spec_k + 1); a step with plan.draft_k also proposes drafts for its
        sampled rows (module docstring); with an MTP head, any other step writes the head's KV at its positions
        (qwen35/mtp.py write_kv)."""
        self._check_spec(plan)
        if plan.spec_k or self._proposes_only(plan, sampling):
            if not plan.spec_k:
                self._feed_host_tokens(plan)
            tokens = self.verify_step(plan, sampling)
            if not plan.spec_k:  # (one token a row: what a plain step gives)
                tokens = tokens[:, 0]
            if half is not None:
                self.host_view(half, plan.num_seqs, plan.spec_k and plan.spec_k + 1).copy_(tokens, non_blocking=True)
            return tokens
        hidden, batch = self._forward(plan)
        if batch is None and self.graphs.tails:  # a graph ran it
            mode = tail_mode(sampling)
            if mode is not None:
                return self.graphs.run_tail(plan.num_seqs, mode, half)
        elif not self.logit_slots.numel():
            if self.model.mtp is not None and batch is not None:  # prompt chunks that sample nothing
                empty = batch.logits_indices[:0]
                write_kv(self.model, batch.positions, batch.slot_mapping, hidden, next_ids(batch, empty, empty))
            return None
        logits = self.model.compute_logits(hidden if batch is None else hidden[batch.logits_indices], gather="none")
        tokens = self.sampler.sample(logits, self.logit_slots, sampling)
        self._feed_tokens(tokens, self.logit_slots, self.slot_tokens,
                          None if half is None else self.host_view(half, len(tokens)))
        if plan.draft_k:
            self._propose(batch, hidden, tokens, batch.logits_indices, plan.draft_k, sampling)
        elif self.model.mtp is not None:
            if batch is None:  # a decode graph ran the forward, its rows in graphs.rows (one a sequence)
                self.graphs.write_head_kv(self.graphs.size, len(tokens), hidden, tokens)
            else:
                write_kv(self.model, batch.positions, batch.slot_mapping, hidden,
                         next_ids(batch, tokens, batch.logits_indices))
        return tokens

    # ---------------------------------------------------------------- speculative decoding
    def _proposes_only(self, plan: StepPlan, sampling) -> bool:
        """Whether a step of decode rows that verifies no drafts and proposes some runs as a verify step of none
        (T = 1): where a verify graph holds it (cuda_graphs.VerifyGraphs), its rows fed from the device or, a prompt's
        last token, from the host (_feed_host_tokens); otherwise it takes the plain step's eager path."""
        return bool(plan.draft_k and not plan.spec_k and self.verify_graphs is not None and plan.is_pure_decode
                    and all(plan.want_logits) and not plan.checkpoints and self.verify_graphs.holds(plan, sampling))

    def _feed_host_tokens(self, plan: StepPlan) -> None:
        """The plan's tokens from the host (decode rows of a step that only proposes: a prompt's last token) into
        their slots' next inputs, where a verify step reads every row's newest token (queued after the steps before,
        which feed their rows' tokens there)."""
        rows = [(slot, t[0]) for slot, t in zip(plan.state_slots, plan.token_ids) if t]
        if rows:  # (one contiguous pinned transfer: slots, then tokens)
            host = torch.tensor([r[0] for r in rows] + [r[1] for r in rows], dtype=torch.int64, pin_memory=self._pin)
            slots, tokens = host.to(self.device, non_blocking=True).view(2, len(rows))
            self.slot_tokens[slots] = tokens

    def _check_spec(self, plan: StepPlan) -> None:
        if not (plan.spec_k or plan.draft_k):
            return
        if max(plan.spec_k, plan.draft_k) > self.spec_max_k or min(plan.spec_k, plan.draft_k) < 0:
            raise ValueError(f"bad step plan: spec_k {plan.spec_k}, draft_k {plan.draft_k}; this runner holds "
                             f"{self.spec_max_k} drafts per slot (--speculative-tokens)")
        if plan.spec_k and not (plan.is_pure_decode and not any(plan.token_ids) and all(plan.want_logits)
                                and not plan.checkpoints):
            raise ValueError("bad step plan: a verify step (spec_k > 0) takes decode rows fed from the device only, "
                             "each wanting logits, and no checkpoint")
        if plan.spec_behind and not plan.spec_k:
            raise ValueError("bad step plan: only a verify step (spec_k > 0) is planned a verify step behind")

    def _sample_batch(self, slots: torch.Tensor, sampling) -> SampleBatch | None:
        """The rows' sampling settings at their current draw numbers (None: every row greedy)."""
        if sampling.greedy_only:
            return None
        s = self.sampler
        p = s.params[slots]
        return SampleBatch(p[:, 0], p[:, 1], p[:, 2], s.keys[slots], s.draws[slots], None, False,
                           sampling.any_top_k, sampling.any_top_p)

    def _propose(self, batch: ForwardBatch, hidden: torch.Tensor, newest: torch.Tensor, last_rows: torch.Tensor,
                 k: int, sampling) -> None:
        """k drafts for the step's sampled rows (self.logit_slots; their newest tokens and last accepted rows) into
        the slots' draft buffers, drawn at the draw numbers after this step's tokens. The head's catch-up covers
        every row of the step; a prefill chunk that does not end its prompt has no sampled token, so its last
        position's entry is written for a stand-in token (the plan does not carry the prompt's next one): drafts
        only, verification is exact."""
        slots = self.logit_slots
        d = propose(self.model, batch, hidden, newest, last_rows, k, self._sample_batch(slots, sampling),
                    block_tables=self.block_table[slots], num_real_tokens=self.sampler.num_real_tokens,
                    max_positions=self.slot_end[slots], draft=self._draft)
        rows = self.draft_rows(slots)
        self.drafts[rows, :k] = d.tokens
        if d.logits is not None:
            self.draft_buffers(d.logits.shape[-1])[0][rows, :k] = d.logits
            self.draft_lse[rows, :k] = d.lse

    def draft_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of the draft buffers that `slots` use: a running sequence's slot its own, the scratch slot (padded
        rows of a verify graph) the buffers' last row."""
        return slots.clamp(max=self.num_state_slots)

    def verify_starts(self, plan: StepPlan) -> tuple[list[int], int]:
        """The verify step's start positions and behind flag as its inputs take them: the plan's, except where the
        torch kernels read the positions on the host (start_pos_cpu) and the plan is a verify step behind, whose
        positions are then worked out here (reading `accepted`: a host sync, the CPU tests' path)."""
        starts = plan.start_pos
        if not plan.spec_behind or backend.use_fast():
            return starts, plan.spec_behind
        return [s + a for s, a in zip(starts, self.accepted[plan.state_slots].tolist())], 0

    def prepare_verify(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor]:
        """A verify step's inputs (verify_inputs) from the plan's rows, with the host lists the torch kernels read."""
        self._set_tables(plan)
        B, T = plan.num_seqs, plan.spec_k + 1
        slots = plan.state_slots
        self._check_rows(slots, plan.start_pos, [1] * B, [s + 1 for s in plan.start_pos])  # (the newest token's)
        starts, behind = self.verify_starts(plan)
        # each row 16-byte aligned, as the graphs' rows are: the kernels compile once for both
        pad = [0] * (backend.aligned_sizes([B], torch.int64)[0] - B)
        host = torch.tensor([*slots, *pad, *starts, *pad, *[behind] * B, *pad], dtype=torch.int64,
                            pin_memory=self._pin)
        slots_d, starts_d, behind_d = host.to(self.device, non_blocking=True).view(3, B + len(pad))[:, :B]
        return self.verify_inputs(slots_d, starts_d, behind_d, T, start_pos_cpu=list(starts),
                                  state_slots_cpu=list(slots))

    def verify_inputs(self, slots: torch.Tensor, starts: torch.Tensor, behind: torch.Tensor, T: int,
                      **host) -> tuple[ForwardBatch, torch.Tensor]:
        """A verify step's inputs as device ops of static shapes only (a CUDA graph holds them: cuda_graphs.
        VerifyGraphs): row b's T tokens at rows b*T .. b*T + T - 1 (layers/verify_rows.py), and per row the drafts it
        may accept [B]: those whose positions have KV blocks (a row near its end has fewer; the scheduler drops tokens
        past max_tokens). slots, starts, behind: [B] int64 on the device (layers/verify_rows.py); `host`: the
        ForwardBatch host lists the torch kernels read (the fast kernels read none; a graph knows none when it is
        captured)."""
        B = slots.shape[0]
        r = self._verify_rows(slots, starts, behind, T, self.slot_end, self.block_table, self.slot_tokens,
                              self.drafts, self.accepted, self.block_size, self.num_kv_blocks)
        self.logit_slots = slots
        fields = dict(
            input_ids=r.input_ids, positions=r.positions, slot_mapping=r.slot_mapping, cu_seqlens=r.cu_seqlens,
            start_pos=r.start_pos, context_lens=r.context_lens, block_tables=r.block_tables, state_slots=slots,
            logits_indices=r.logits_indices, seq_lens_cpu=[T] * B, start_pos_cpu=[0] * B,
            state_slots_cpu=[self.scratch_slot] * B, is_decode=False, verify_tokens=T)
        fields.update(host)
        return ForwardBatch(**fields), r.num_drafts

    @torch.inference_mode()
    def verify_step(self, plan: StepPlan, sampling) -> torch.Tensor:
        """Every rank: a verify step (module docstring); returns [n, T] int64 on the device, the same on every
        rank: row b's emitted tokens (its accepted drafts, then the target's token), -1 after them. A replay of
        a verify graph where one holds the step (cuda_graphs.VerifyGraphs.holds), else queued eagerly."""
        self._apply_copies(plan)
        graphs = self.verify_graphs
        if graphs is not None and graphs.holds(plan, sampling):
            n = plan.num_seqs
            self._set_tables(plan)
            self._check_rows(plan.state_slots, plan.start_pos, [1] * n, [s + 1 for s in plan.start_pos])
            starts, behind = self.verify_starts(plan)
            tokens = graphs.run(plan.state_slots, starts, behind, plan.spec_k, plan.draft_k, tail_mode(sampling))
            self.logit_slots = graphs.rows[0, :n]
            self.verify_counts["graph"] += bool(plan.spec_k)  # (steps that verify drafts)
            return tokens
        self.verify_counts["eager"] += 1
        batch, num_drafts = self.prepare_verify(plan)
        return self.verify_forward(batch, num_drafts, sampling, plan.draft_k)

    def verify_forward(self, batch: ForwardBatch, num_drafts: torch.Tensor, sampling, draft_k: int) -> torch.Tensor:
        """The device work of a verify step (verify_inputs' batch and drafts per row): the forward, the logits at
        every position, acceptance, the DeltaNet commit, each slot fed its last emitted token and its draw counter
        moved on, the drafts each accepted kept (`accepted`), then draft_k drafts proposed for every row. Returns the
        emitted tokens [B, T] (-1 after them)."""
        hidden = self.model(batch)
        B, T = batch.state_slots.shape[0], batch.verify_tokens
        logits = self.model.compute_logits(hidden, gather="none")  # this rank's vocabulary shard
        slots = batch.state_slots
        rows_d = self.draft_rows(slots)
        drafts = self.drafts[rows_d, :T - 1]
        rows = self._sample_batch(slots, sampling)
        q = (None, None) if rows is None else (self.draft_logits[rows_d, :T - 1], self.draft_lse[rows_d, :T - 1])
        verdict = self._verify(logits.view(B, T, -1), drafts, *q, rows, num_drafts, self.sampler.num_real_tokens,
                               self.config.vocab_size)
        counts = verdict.num_emitted
        deltanet.commit(self.gdn_layers, counts)
        last = verdict.tokens.gather(1, (counts - 1)[:, None])[:, 0]
        self.slot_tokens[slots] = last
        self.sampler.draws[slots] += counts
        self.accepted[slots] = counts - 1
        if self.pending is not None:  # (the states take the accepted drafts at the slots' next step)
            self.pending[slots] = counts - 1
        last_rows = torch.arange(0, B * T, T, device=self.device) + counts - 1
        if draft_k:
            self._propose(batch, hidden, last, last_rows, draft_k, sampling)
        else:  # (auto back at k = 0: the head's KV at the accepted positions all the same)
            write_kv(self.model, batch.positions, batch.slot_mapping, hidden, next_ids(batch, last, last_rows))
        return verdict.tokens

    def draft_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What sampled drafts were drawn from: (logits [draft rows, K, n] float32, this rank's vocabulary shard
        of n columns; their log-sum-exp [draft rows, K]), made when first needed."""
        if self.draft_logits is None:
            self.draft_logits = torch.zeros(*self.drafts.shape, n, device=self.device)
            self.draft_lse = torch.zeros(*self.drafts.shape, device=self.device)
        return self.draft_logits, self.draft_lse

    # ---------------------------------------------------------------- warm-up
    def rows_plan(self, rows: list[tuple[int, int]], ids, checkpoint: int = 0) -> StepPlan | None:
        """A step of `rows` (start, tokens; 0 tokens = a decode row fed from the device) on slots and blocks from 0,
        every row wanting logits, with `ids(n)` for a row's tokens; the last `checkpoint` rows that run the prefill
        kernels get a checkpoint at their end, each in a snapshot slot of its own (as many as there are); None if
        the rows do not fit the state slots, the KV cache or max_model_len."""
        if len(rows) > self.max_num_seqs:
            return None
        p, block = StepPlan(), 0
        for slot, (start, n) in enumerate(rows):
            nblk = -(-(start + max(n, 1)) // self.block_size)
            if start + max(n, 1) > self.max_model_len or block + nblk > self.num_kv_blocks:
                return None
            p.state_slots.append(slot)
            p.token_ids.append(ids(n) if n else [])
            p.start_pos.append(start)
            p.block_tables.append(list(range(block, block + nblk)))
            p.want_logits.append(True)
            block += nblk
        ends = [(i, start + n) for i, (start, n) in enumerate(rows) if n and can_checkpoint(start, n, start + n, CHUNK)]
        for (i, end), slot in zip(ends[::-1][:checkpoint], self.snapshot_slots):
            p.checkpoints.append((i, end, slot))
        return p

    def warm_up_plans(self, max_tokens: int) -> list[StepPlan]:
        """Steps that meet, before any request does, the kernel variants a prefill or mixed step can meet. Triton
        compiles a kernel the first time it sees a new tile (the MoE tiles go by token bucket) or a new
        specialisation (an integer argument equal to 1 or divisible by 16, a pointer aligned to 16 bytes or not).
        Each compile costs ~1 s, which a cold trace level paid in the middle of serving (2026-11-25, 1x H200: 31
        compiles, 46 s for ~11 s of work). The kernels keep a step's make-up out of their keys (per-step integers
        and metadata pointers are do_not_specialize, buffers carved from one allocation start aligned, the tiles
        over sequences and checkpoints have floors), so what is left to meet is the token buckets, with and
        without checkpoints and decode rows; tests/test_compile_keys.py checks random steps against these.
        Per token bucket t up to max_tokens (the powers of two, and the MoE's tuned buckets between them:
        tiles.token_buckets) and n in (t, t - 1): one fresh prompt of n tokens (a checkpoint
        at its end when n is t - 1), n tokens as 2 and as 16 fresh prompts, and mixed steps of 1, 2, 4, 15 and 16
        decode rows (fed from the device) then a chunk resuming at CHUNK (row counts: 1, other and divisible by 16,
        for the decode rows and for all rows). Then each tile over sequences past the first (varlen.seq_tile: 16,
        32, 64, ... sequences, up to max_num_seqs) in a step of that many 2-token prompts, with no checkpoint and
        with one at every row's end (the state kernel's checkpoint tile: past 64, one per power of two). Rows take
        slots and blocks from 0; what they leave behind is written again before any request reads it (a fresh row
        ignores its slot's state). Steps that do not fit are left out (rows_plan)."""
        gen = torch.Generator().manual_seed(0)
        vocab = self.config.vocab_size

        def ids(n: int) -> list[int]:
            return torch.randint(0, max(1, vocab - 300), (n,), generator=gen).tolist()

        moe = next((m for m in self.model.modules() if isinstance(m, SparseMoE)), None)
        buckets = moe.token_buckets(max_tokens) if moe is not None else token_buckets(max_tokens)
        plans = []
        for t in buckets:
            for n in sorted({t, t - 1} - {0}):
                candidates = [self.rows_plan([(0, n)], ids, checkpoint=n < t)]
                for r in (2, 16):
                    if n >= 2 * r:
                        candidates.append(self.rows_plan([(0, n // r)] * (r - 1) + [(0, n - (r - 1) * (n // r))], ids))
                for d in (1, 2, 4, 15, 16):
                    if n - d >= 2:
                        candidates.append(self.rows_plan([(CHUNK, 0)] * d + [(CHUNK, n - d)], ids, checkpoint=d == 1))
                plans += [p for p in candidates if p is not None]
        b = SEQ_TILE
        while b <= self.max_num_seqs and 2 * b <= max_tokens:
            plans += [p for p in (self.rows_plan([(0, 2)] * b, ids, checkpoint=c) for c in (0, b)) if p is not None]
            b *= 2
        return plans

    def _warm_up_verify(self, num_real_tokens: int) -> None:
        """What a verify step runs besides the kernels the prefill and decode steps compile: the decode attention
        at every variant its row counts (batch x (k + 1)) can meet, the speculative sampling passes (greedy and
        sampled drafts and verdicts: collective, as on every rank), and the DeltaNet verify and commit kernels'
        variants (layers/deltanet_verify.py: the slab width goes by rows, decode_launch); on the scratch slot and
        the scratch KV block."""
        a = self.attn_layers[0]
        rows_max = self.max_num_seqs * (self.spec_max_k + 1)
        W = self.block_table.shape[1]
        for r in decode_variant_rows(rows_max, a.num_kv_heads, W * self.block_size, a.head_dim, self.device):
            q = torch.zeros(r, a.num_heads, a.head_dim, dtype=self.dtype, device=self.device)
            tables = torch.full((r, W), self.num_kv_blocks, dtype=torch.int32, device=self.device)
            a._decode(q, a.k_cache, a.v_cache, tables, torch.ones(r, dtype=torch.int32, device=self.device), 1.0,
                      q if a.gated else None)
        self._warm_up_spec_sampling(num_real_tokens)
        if not self.gdn_layers:
            return
        from layers.deltanet import DECODE_CONFIG
        m, T = self.gdn_layers[0], 2  # (T is never 1 or a multiple of 16: one variant)
        width = m.conv_dim + m.num_v_heads * m.dv + 2 * m.num_v_heads
        for rows in (1, DECODE_CONFIG["batched_from"]):
            proj = torch.zeros(rows * T, width, dtype=self.dtype, device=self.device)
            slots = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=self.device)
            m.verify(proj, slots, T)
            deltanet.commit([m], torch.ones(rows, dtype=torch.int64, device=self.device))
            m.settle(slots)

    def _warm_up_spec_sampling(self, num_real_tokens: int) -> None:
        """One row's draft and verdict, greedy and sampled, on zero logits (every variant of the sampling passes;
        before the sampler is attached: the tokenizer's count of real tokens is given)."""
        n = self.model.lm_head.weight.shape[0]
        one = torch.ones(1, device=self.device)
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        sampled = SampleBatch(one, one * 0, one, ids, ids, None, False, False, False)
        for batch in (None, sampled):
            d = self._draft(torch.zeros(1, n, device=self.device), batch, num_real_tokens, self.config.vocab_size)
            self._verify(torch.zeros(1, 2, n, device=self.device), d.tokens[:, None], torch.zeros(1, 1, n,
                         device=self.device), d.lse[:, None], batch, None, num_real_tokens, self.config.vocab_size)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, num_real_tokens: int | None = None) -> int:
        """Run warm_up_plans (every rank, the same plans), and with speculation the verify step's kernels
        (num_real_tokens: the tokenizer's, which the sampling passes mask past; needed then, as the sampler is
        attached after the warm-up); returns how many plans ran."""
        plans = self.warm_up_plans(max_tokens)
        for plan in plans:
            self.execute(plan, gather="none")
        if self.spec_max_k and self.kernels == "fast" and self.device.type == "cuda":
            if num_real_tokens is None:
                raise ValueError("warm_up with speculation needs num_real_tokens (the tokenizer's)")
            self._warm_up_verify(num_real_tokens)
        if self._feed_tokens is feed_tokens_fast and self.device.type == "cuda":
            # the feed kernel's two variants (rank 0's also writes the host's buffer), on the scratch slot
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            slot = torch.full((1,), self.scratch_slot, dtype=torch.int64, device=self.device)
            host = torch.empty(1, dtype=torch.int64, pin_memory=True)  # (held until the synchronize below)
            self._feed_tokens(token, slot, self.slot_tokens)
            self._feed_tokens(token, slot, self.slot_tokens, host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(plans)


def _copy_waves(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Copies (src, dst) done in order, split where a copy reads or writes what an earlier one of its wave writes:
    within a wave all sources are read before any destination is written, which is the in-order result."""
    waves, wave, written = [], [], set()
    for src, dst in pairs:
        if src in written or dst in written:
            waves.append(wave)
            wave, written = [], set()
        wave.append((src, dst))
        written.add(dst)
    return waves + [wave] if wave else waves
