"""The engine's settings. EngineArgs is the one table of them and of their defaults: the command line (add_cli_args),
the offline LLM, the logits-level create_engine, the engine and its ModelRunner are all built from it. EngineConfig
holds what the settings resolve to on a machine for a model: the device, the dtype and the longest sequence."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields

import torch

from layers.deltanet_prefill import CHUNK
from qwen35.checkpoint import has_mtp_weights
from qwen35.config import ModelConfig
from scheduler.prefix_cache import check_snapshot_interval
from scheduler.speculation import MAX_K, max_drafts, parse_speculative_tokens

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# a longer context than this must be asked for: each running sequence may reserve its KV blocks up to it
DEFAULT_MAX_MODEL_LEN = 32768


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None / "auto": cuda when available, else cpu; a cuda device gets the current index."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """None / "auto": bf16 on GPU, fp32 on CPU; else a name of DTYPES or a torch dtype."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int

    @classmethod
    def resolve(cls, model: ModelConfig, device=None, dtype=None, max_model_len: int | None = None) -> "EngineConfig":
        """device/dtype None or "auto": see resolve_device/resolve_dtype; max_model_len None: the model's
        max_position_embeddings, at most DEFAULT_MAX_MODEL_LEN."""
        limit = model.max_position_embeddings
        length = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if length > limit:
            raise ValueError(f"max_model_len {length} exceeds the model's max_position_embeddings {limit}")
        dev = resolve_device(device)
        return cls(model, dev, resolve_dtype(dtype, dev), length)


@dataclass
class EngineArgs:
    model: str                                # a model directory, a Hugging Face id or a preset (qwen35/hub.py)
    tp: int | None = None                     # None: WORLD_SIZE
    dtype: str | None = None                  # None / "auto": bfloat16 on cuda, float32 on cpu
    device: str | None = None                 # None / "auto": cuda when available
    load_format: str = "safetensors"          # "safetensors" | "dummy" (random weights, no files read) | "dummy-spec"
                                              # (random weights with a chosen MTP draft acceptance: qwen35/synth_spec.py)
    spec_acceptance: float = 0.6              # "dummy-spec": the draft acceptance its weights are made for
    mtp: bool = False                         # build the MTP head (qwen35/mtp.py; "dummy-spec" needs it)
    speculative_tokens: int | str | None = None  # drafts verified per decode step: K, 0 (off) or "auto"
                                              # (scheduler/speculation.py; needs the MTP head, built when not 0);
                                              # None: auto on a GPU where the model has its head, else 0
                                              # (resolve_speculation)
    spec_cost_table: str | None = None        # "auto": a bench results JSON as the cost table, or "measure" (at
                                              # start); default: the shipped one, else measured at start on GPUs
    block_size: int = 16
    max_num_seqs: int = 128                   # concurrent sequences = DeltaNet state slots
    max_num_batched_tokens: int = 8192        # tokens per forward step (decodes + prefill chunks)
    max_model_len: int | None = None          # None: min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None          # None: as many as fit (gpu_memory_utilization) or are useful
    enforce_eager: bool = False
    seed: int = 0
    prefix_cache: bool = True                 # the hybrid prefix cache (scheduler/prefix_cache.py)
    prefix_cache_snapshots: int = 128         # DeltaNet state snapshots it may hold (fixed memory, LRU)
    prefix_cache_interval: int = 256          # a snapshot every this many prompt tokens (0: none)
    kernels: str | None = None                # "torch" | "fast"; None: $QWEN35_KERNELS, else fast on CUDA, torch on CPU
    overlap: bool = True                      # prepare step N+1 on the host while the device runs step N
    warm_up: bool = True                      # compile the prefill / mixed-step kernels at start (fast kernels on CUDA)

    @property
    def device_type(self) -> str:
        """For init_distributed, before anything is built (EngineConfig resolves the rest)."""
        return resolve_device(self.device).type

    @property
    def random_weights(self) -> bool:
        """Whether the weights are made at start (the dummy load formats), not read from a checkpoint."""
        return self.load_format in ("dummy", "dummy-spec")

    @property
    def spec_max_k(self) -> int:
        """The most drafts a step may verify (the runner's draft buffers' width): 0 without speculation, and while
        the setting is not resolved (None: a runner built without an engine)."""
        return max_drafts(self.speculative_tokens or 0)

    @property
    def builds_mtp(self) -> bool:
        """Whether the runner builds the MTP head: asked for, needed by dummy-spec, or by speculation."""
        return self.mtp or self.load_format == "dummy-spec" or self.spec_max_k > 0

    def resolve_speculation(self, config: ModelConfig, model_dir: str | None) -> None:
        """--speculative-tokens when not given (None): `auto` on a GPU where the model has its MTP head (in its
        config, and in its weights: the checkpoint's `mtp.*` tensors, or made by a dummy load format), else 0.
        Served, the users' procedure with `auto` scored 1.08x (TP=1) and 1.07x (TP=2) of speculation off at a
        synthetic acceptance of 0.6 (2x / 1x H200, 2026-11-29; WRITEUP's issue #28 section); where drafts are never
        accepted it verifies on a few steps in a hundred. On the CPU its cost table would be a placeholder, not a
        measurement: off."""
        if self.speculative_tokens is not None:
            return
        head = config.mtp_num_hidden_layers == 1 and (
            self.random_weights or (model_dir is not None and has_mtp_weights(model_dir)))
        self.speculative_tokens = "auto" if head and self.device_type == "cuda" else 0

    @property
    def num_snapshot_slots(self) -> int:
        """DeltaNet state slots the runner keeps for the prefix cache's snapshots."""
        return self.prefix_cache_snapshots if self.prefix_cache else 0

    def check(self) -> None:
        """ValueError naming the flag, before anything is loaded (what only the model tells is checked later)."""
        if self.speculative_tokens is not None:
            self.speculative_tokens = parse_speculative_tokens(self.speculative_tokens)
        if not 0.0 < self.spec_acceptance < 1.0:
            raise ValueError(f"--spec-acceptance must be in (0, 1); got {self.spec_acceptance}")
        if self.prefix_cache:
            if self.prefix_cache_snapshots < 1:
                raise ValueError(f"--prefix-cache-snapshots must be >= 1 (got {self.prefix_cache_snapshots}); "
                                 "--no-prefix-cache turns the cache off")
            check_snapshot_interval(self.prefix_cache_interval, CHUNK)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = {f.name: f.default for f in fields(EngineArgs) if f.default is not MISSING}
        g = parser.add_argument_group("engine")
        g.add_argument("--model", required=True, help="model directory, Hugging Face id, or preset (tiny, ...)")
        g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=d["tp"],
                       help="tensor parallel size (default: WORLD_SIZE of the torchrun job)")
        g.add_argument("--dtype", default=d["dtype"], choices=["auto", *DTYPES],
                       help="default: bfloat16 on cuda, float32 on the CPU")
        g.add_argument("--device", default=d["device"], help="auto, cuda or cpu (default: cuda when available)")
        g.add_argument("--load-format", default=d["load_format"], choices=["safetensors", "dummy", "dummy-spec"],
                       help="dummy: random weights; dummy-spec: random weights whose MTP head drafts with the "
                            "acceptance --spec-acceptance (implies --mtp)")
        g.add_argument("--spec-acceptance", type=float, default=d["spec_acceptance"],
                       help="with --load-format dummy-spec: the draft acceptance the weights are made for")
        g.add_argument("--mtp", action="store_true", default=d["mtp"], help="build the checkpoint's MTP head")
        g.add_argument("--speculative-tokens", default=d["speculative_tokens"], type=parse_speculative_tokens,
                       help=f"speculative decoding with the MTP head: drafts verified per decode step, 0..{MAX_K} "
                            "(0: off) or auto (chosen per step from the batch size, the running acceptance and a "
                            "cost table); implies --mtp. Default: auto on a GPU where the checkpoint has its MTP "
                            "head, else 0")
        g.add_argument("--spec-cost-table", default=d["spec_cost_table"],
                       help="with --speculative-tokens auto: the results JSON of qwen35.bench --mode spec on this "
                            "machine as the cost table, or 'measure': one measured at start (spec steps on random "
                            "prompts, before serving). Default: the table measured on this GPU kind and TP that "
                            "ships in scheduler/spec_costs.json, else measured at start (a placeholder on the CPU)")
        g.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per paged-KV block")
        g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                       help="most concurrent sequences (also the number of DeltaNet state slots)")
        g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                       help="token budget of one step")
        g.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                       help="longest prompt + completion (default: min(max_position_embeddings, "
                            f"{DEFAULT_MAX_MODEL_LEN}))")
        g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                       help="fraction of GPU memory for weights + caches")
        g.add_argument("--num-kv-blocks", type=int, default=d["num_kv_blocks"],
                       help="override the KV cache size (blocks)")
        g.add_argument("--enforce-eager", action="store_true", default=d["enforce_eager"], help="no CUDA graphs")
        g.add_argument("--seed", type=int, default=d["seed"], help="seed of the dummy weights and unseeded sampling")
        g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=d["prefix_cache"],
                       help="no prefix cache: every prompt is prefilled whole")
        g.add_argument("--prefix-cache-snapshots", type=int, default=d["prefix_cache_snapshots"],
                       help="DeltaNet state snapshots the prefix cache keeps (each one slot of every DeltaNet layer's "
                            "conv and recurrent state, allocated at start; least recently used go first)")
        g.add_argument("--prefix-cache-interval", type=int, default=d["prefix_cache_interval"],
                       help="snapshot every this many prompt tokens, so that prompts sharing a prefix resume close "
                            f"to where they part (a multiple of {CHUNK}; 0: only at prompt ends and where prompts "
                            "part)")
        g.add_argument("--kernels", default=d["kernels"], choices=["torch", "fast"],
                       help="torch: reference ops; fast: fused Triton kernels (default: $QWEN35_KERNELS, else fast "
                            "on CUDA, torch on the CPU)")
        g.add_argument("--no-overlap", dest="overlap", action="store_false", default=d["overlap"],
                       help="run each step to its end before preparing the next (same tokens, host time exposed)")
        g.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=d["warm_up"],
                       help="skip the start-up steps that compile every prefill and mixed-step kernel variant (they "
                            "are then compiled, ~1 s each, by the first requests that need them)")
        return parser

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
