"""qwen35: a tensor-parallel inference engine for the Qwen3.5 family.

    from qwen35 import LLM, SamplingParams, create_engine
"""
from scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "create_engine"]


def __getattr__(name):
    # imported on first use, so that `import qwen35.config` (and the synth/tokenizer tools) stay light
    if name == "LLM":
        from qwen35.llm import LLM
        return LLM
    if name == "create_engine":
        from qwen35.api import create_engine
        return create_engine
    raise AttributeError(f"module 'qwen35' has no attribute {name!r}")
