"""ModelRunner: one rank's model shard, its caches, and the forward of one StepPlan.

Every rank holds one. The caches are allocated once, at fixed addresses: per full-attention layer a paged KV cache
[blocks, block_size, kv_heads, head_dim]; per DeltaNet layer a conv tail [slots, conv_dim, kernel-1] and an fp32
recurrent state [slots, v_heads, dk, dv]. A StepPlan addresses them by block id and state slot only.
"""
from __future__ import annotations

import logging
import math
import zlib

import torch

from dist import parallel
from layers import backend
from layers.attention import GatedAttention
from layers.deltanet import GatedDeltaNet
from layers.forward_batch import ForwardBatch
from qwen35.checkpoint import load_checkpoint
from qwen35.config import ModelConfig
from qwen35.model import Qwen35Model
from scheduler.plan import StepPlan

log = logging.getLogger("qwen35.runner")


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """None / "auto": bf16 on GPU, fp32 on CPU; else a name of DTYPES or a torch dtype."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    return dtype


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
    def __init__(self, config: ModelConfig, model_dir: str | None = None, load_format: str = "safetensors",
                 dtype=None, device=None, block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85,
                 num_kv_blocks: int | None = None, enforce_eager: bool = False, seed: int = 0,
                 num_snapshot_slots: int = 0, kernels: str | None = None):
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.num_snapshot_slots = num_snapshot_slots
        self.max_model_len = max_model_len or min(config.max_position_embeddings, 32768)
        self.enforce_eager = enforce_eager
        config.check_tp(parallel.tp_size())
        # the kernel set is chosen once, here: the layers bind their implementations as they are built
        self.kernels = backend.resolve(kernels, self.device)
        backend.set_kernels(self.kernels)
        torch.manual_seed(seed)
        self.model = Qwen35Model(config, dtype=self.dtype, device=self.device, max_positions=self.max_model_len)
        if load_format == "dummy":
            init_dummy_weights(self.model, seed)
        elif load_format == "safetensors":
            if model_dir is None:
                raise ValueError("load_format 'safetensors' needs a model directory")
            load_checkpoint(self.model, model_dir, self.device, progress=parallel.is_driver())
        else:
            raise ValueError(f"unknown load_format {load_format!r} (use 'safetensors' or 'dummy')")
        self.model.eval()
        if self.device.type == "cuda" and self.kernels == "fast":
            # small all-reduces over peer buffers (dist/allreduce.py), set up before the KV budget is measured
            elt = torch.empty((), dtype=self.dtype).element_size()
            parallel.setup_symmetric_all_reduce(max_num_seqs * config.hidden_size * elt, self.device)
        self._allocate_caches(gpu_memory_utilization, num_kv_blocks)
        self.graphs = None
        if self.device.type == "cuda" and not enforce_eager:
            if not all(getattr(m, "sync_free", True) for m in self.model.modules()):
                # the torch experts loop over the experts a batch hits, a host sync a CUDA graph cannot hold
                log.warning("no CUDA graphs: kernels %r wait for the host (use --kernels fast)", self.kernels)
            else:
                from qwen35.cuda_graphs import DecodeGraphs
                self.graphs = DecodeGraphs(self)

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
        self.num_state_slots = self.max_num_seqs
        self.snapshot_slots = list(range(self.max_num_seqs, self.max_num_seqs + self.num_snapshot_slots))
        self.scratch_slot = slots - 1
        elt = torch.empty((), dtype=self.dtype).element_size()
        per_block = sum(2 * self.block_size * m.num_kv_heads * m.head_dim * elt for m in attn)
        # more blocks than every slot filled to max_model_len can never be used (no prefix sharing yet)
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
            log.info("caches: %d KV blocks of %d tokens (%.1f MiB), %d DeltaNet state slots", num_kv_blocks,
                     self.block_size, num_kv_blocks * per_block / 2**20, self.num_state_slots)

    # ---------------------------------------------------------------- forward
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        bs = self.block_size
        seq_lens = [len(t) for t in plan.token_ids]
        for i, (n, start, table) in enumerate(zip(seq_lens, plan.start_pos, plan.block_tables)):
            if n == 0 or len(table) * bs < start + n or not 0 <= plan.state_slots[i] < self.num_state_slots:
                raise ValueError(f"bad step plan for sequence {i}: {n} tokens at {start}, {len(table)} blocks, "
                                 f"slot {plan.state_slots[i]}")
        max_blocks = max(len(t) for t in plan.block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in plan.block_tables], dtype=torch.int64)
        starts = torch.tensor(plan.start_pos, dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        positions = starts[seq_of_token] + torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
        slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs
        want = [i for i, w in enumerate(plan.want_logits) if w]
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor([t for ids in plan.token_ids for t in ids], dtype=torch.int64).to(dev),
            positions=positions.to(dev),
            slot_mapping=slot_mapping.to(dev),
            cu_seqlens=cu.to(torch.int32).to(dev),
            start_pos=starts.to(torch.int32).to(dev),
            context_lens=(starts + lens).to(torch.int32).to(dev),
            block_tables=tables.to(torch.int32).to(dev),
            state_slots=torch.tensor(plan.state_slots, dtype=torch.int64).to(dev),
            logits_indices=(cu[1:] - 1)[want].to(dev),
            seq_lens_cpu=seq_lens,
            start_pos_cpu=list(plan.start_pos),
            state_slots_cpu=list(plan.state_slots),
            is_decode=plan.is_pure_decode,
        )

    def _apply_copies(self, plan: StepPlan) -> None:
        """Prefix-cache copies, in plan order (a snapshot may be taken and read in the same step)."""
        for src, dst in plan.copy_states:
            for m in self.gdn_layers:
                m.conv_state[dst].copy_(m.conv_state[src])
                m.ssm_state[dst].copy_(m.ssm_state[src])
        for src, dst in plan.copy_blocks:
            for m in self.attn_layers:
                m.k_cache[dst].copy_(m.k_cache[src])
                m.v_cache[dst].copy_(m.v_cache[src])

    @torch.inference_mode()
    def execute(self, plan: StepPlan, gather_to_all: bool = False, eager: bool = False) -> torch.Tensor | None:
        """Run one step; logits [n_want_logits, vocab] float32 on rank 0 (or on all ranks with gather_to_all).
        `eager` skips the CUDA graphs (kernel counts)."""
        self._apply_copies(plan)
        batch = self.prepare(plan)
        if not eager and self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.logits_indices], gather_to_all=gather_to_all)
