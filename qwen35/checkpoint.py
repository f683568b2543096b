"""Load a Hugging Face checkpoint (Qwen3.5 or a dense LLaMA-like) into a (tensor-parallel shard of the) model:
safetensors (one file, or sharded with an index), or where a directory has no safetensors, one PyTorch state dict
`model.pt` with the same names (read with torch.load(weights_only=True, mmap=True): only the pages of the slices a
rank keeps are read).

Each rank opens the files lazily (`safe_open` + `get_slice`) and reads only the ranges of each tensor that its
parameters keep (see layers/linear.py), straight to its device, so host memory holds one tensor slice at a time.
Checkpoint names `model.language_model.X` (multimodal release) and `model.X` (text-only save) both map to module
`X`; `lm_head.weight` stays; `model.visual.*` is skipped, and so is `mtp.*` unless the model has an MTP head
(qwen35/mtp.py: its parameters are named `mtp.X` as in the checkpoint). Experts load fused (`experts.gate_up_proj`)
or per expert (`experts.{e}.gate_proj.weight`, ...), the MTP layer's too (per expert in the 35B-A3B release).
"""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from layers.linear import default_weight_loader
from layers.moe import Experts

SKIP_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
SKIP_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer older transformers saved with the weights; we compute our own
STATE_DICT_FILE = "model.pt"
TORCH_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
TEXT_PREFIXES = ("model.language_model.", "model.")
PER_EXPERT = re.compile(r"^((?:mtp\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}


class TensorSource:
    """A lazily read checkpoint tensor: `.shape`, `.read(index)` -> tensor of just that slice."""

    def __init__(self, handle, name: str, file: str, device):
        self._slice = handle.get_slice(name)
        self.name, self.file, self.device = name, file, device
        self.shape = tuple(self._slice.get_shape())
        self.dtype = self._slice.get_dtype()

    def read(self, index) -> torch.Tensor:
        return self._slice[index].to(self.device)


class InMemorySource:
    """The same interface over a tensor already in memory (tests, tied weights)."""

    def __init__(self, tensor: torch.Tensor, name: str, file: str = "<memory>"):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"entry {name!r} in {file} is a {type(tensor).__name__}, not a tensor")
        self.tensor, self.name, self.file, self.shape = tensor, name, file, tuple(tensor.shape)
        self.dtype = TORCH_DTYPES.get(tensor.dtype, str(tensor.dtype))

    def read(self, index) -> torch.Tensor:
        return self.tensor[index]


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """Map tensor name -> file path, from the index when there is one, else from every *.safetensors file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (nor a {STATE_DICT_FILE}) in {model_dir}")
    mapping = {}
    for file in files:
        path = os.path.join(model_dir, file)
        with safe_open(path, framework="pt") as handle:
            mapping.update({name: path for name in handle.keys()})
    return mapping


def has_mtp_weights(model_dir: str) -> bool:
    """Whether the safetensors checkpoint in `model_dir` holds an MTP head's tensors (`mtp.*`); False for a
    directory without safetensors (a model.pt state dict is not opened to look)."""
    try:
        return any(name.startswith(MTP_PREFIX) for name in checkpoint_files(model_dir))
    except FileNotFoundError:
        return False


def module_name(ckpt_name: str, mtp: bool = False) -> str | None:
    """Our parameter name for a checkpoint tensor name, or None for tensors the text model (with an MTP head when
    `mtp`) does not use."""
    if ckpt_name.startswith(SKIP_PREFIXES) or ckpt_name.endswith(SKIP_SUFFIXES):
        return None
    if ckpt_name.startswith(MTP_PREFIX):
        return ckpt_name if mtp else None
    if ckpt_name == "lm_head.weight":
        return ckpt_name
    for prefix in TEXT_PREFIXES:
        if ckpt_name.startswith(prefix):
            return ckpt_name[len(prefix):]
    return None


class _Tracker:
    """Which parameters have been filled, so that a missing tensor is an error naming it."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.done: set[str] = set()
        self.skipped: list[str] = []  # checkpoint names that are not the text model's
        self.expert_parts: dict[str, set] = {}

    def missing(self, model) -> list[str]:
        missing = []
        for name in self.params:
            if name in self.done:
                continue
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(owner, Experts):
                parts = self.expert_parts.get(name.rsplit(".", 1)[0], set())
                per = 2 if name.endswith("gate_up_proj") else 1
                kinds = {"gate_proj", "up_proj"} if per == 2 else {"down_proj"}
                if sum(1 for _, k in parts if k in kinds) == owner.num_local * per:
                    continue
            missing.append(name)
        return missing


def load_checkpoint(model, model_dir: str, device, progress: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`: its safetensors, else its model.pt."""
    state_dict_file = os.path.join(model_dir, STATE_DICT_FILE)
    has_safetensors = os.path.exists(os.path.join(model_dir, "model.safetensors.index.json")) or any(
        f.endswith(".safetensors") for f in os.listdir(model_dir))
    if not has_safetensors and os.path.isfile(state_dict_file):
        return load_torch_state_dict(model, state_dict_file)
    files = checkpoint_files(model_dir)
    tracker = _Tracker(model)
    by_file: dict[str, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(files), desc="loading weights", unit="tensor")
    for path, names in sorted(by_file.items()):
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file {path} (listed in the index) does not exist")
        with safe_open(path, framework="pt") as handle:
            for name in names:
                _load_one(model, tracker, TensorSource(handle, name, path, device))
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    _tie_lm_head(model, tracker)
    missing = tracker.missing(model)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "") + _names_hint(tracker))


def load_torch_state_dict(model, path: str) -> None:
    """Load a PyTorch state dict file (HF parameter names), memory-mapped: tensors only (weights_only)."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"cannot read {path} as a PyTorch state dict (torch.load weights_only, mmap): "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a state dict (name -> tensor)")
    load_state_dict(model, state_dict, path)


def load_state_dict(model, state_dict: dict[str, torch.Tensor], file: str = "<memory>") -> None:
    """Load from in-memory tensors named as in a checkpoint (same rules and checks as files)."""
    tracker = _Tracker(model)
    for name, tensor in state_dict.items():
        _load_one(model, tracker, InMemorySource(tensor, str(name), file))
    _tie_lm_head(model, tracker)
    missing = tracker.missing(model)
    if missing:
        raise ValueError(f"state dict {file} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "") + _names_hint(tracker))


def _names_hint(tracker: _Tracker) -> str:
    """When nothing loaded, what the names looked like (a state dict saved without the `model.` prefix, say); when
    only the MTP head is missing, that the checkpoint has none."""
    wants_mtp = any(n.startswith(MTP_PREFIX) for n in tracker.params)
    if wants_mtp and not any(n.startswith(MTP_PREFIX) for n in (*tracker.done, *tracker.expert_parts)) \
            and tracker.done - {"lm_head.weight"}:
        return "; the checkpoint has no MTP head (mtp.*): build the model without one"
    if tracker.done - {"lm_head.weight"} or not tracker.skipped:
        return ""
    return (f"; none of its {len(tracker.skipped)} tensor names is a Hugging Face name of the text model "
            f"(model.layers.0.self_attn.q_proj.weight, ...): e.g. {', '.join(tracker.skipped[:3])}")


def _load_one(model, tracker: _Tracker, src) -> None:
    name = module_name(src.name, getattr(model, "mtp", None) is not None)
    if name is None:
        tracker.skipped.append(src.name)
        return
    dtype = getattr(src, "dtype", None)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"tensor {src.name!r} in {src.file} has dtype {dtype}; only floating-point (BF16/F16/F32) "
                         "checkpoints are supported")
    m = PER_EXPERT.match(name)
    if m:
        experts = model.get_submodule(m.group(1))
        experts.load_expert(src, int(m.group(2)), m.group(3))
        tracker.expert_parts.setdefault(m.group(1), set()).add((int(m.group(2)), m.group(3)))
        return
    param = tracker.params.get(name)
    if param is None:
        raise ValueError(f"tensor {src.name!r} in {src.file} matches no parameter of the model "
                         "(is the config right for this checkpoint?)")
    default_weight_loader(param, src)
    tracker.done.add(name)


def _tie_lm_head(model, tracker: _Tracker) -> None:
    if "lm_head.weight" in tracker.done or not model.config.tie_word_embeddings:
        return
    emb = tracker.params["embed_tokens.weight"]
    if "embed_tokens.weight" in tracker.done:
        # the vocab shards of embedding and head are the same rows, so the head copies the embedding shard
        tracker.params["lm_head.weight"].data.copy_(emb.data)
        tracker.done.add("lm_head.weight")
