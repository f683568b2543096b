"""SamplingParams, public as qwen35.SamplingParams; it lives in scheduler/sampling_params.py, a leaf module that
the scheduler's request record and the server import without importing the engine."""
from scheduler.sampling_params import GREEDY_TEMPERATURE, INT64, MAX_TEMPERATURE, SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "INT64", "MAX_TEMPERATURE", "SamplingParams"]
