"""EngineConfig: the device, the dtype and the longest sequence the engine runs with, every default resolved here
once (the engine, the model runner and the logits-level API all take theirs from it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen35.config import ModelConfig

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
