"""Benchmarks of the engine, in a room of their own: the runtime (qwen35/ outside this package, layers/, dist/,
scheduler/, server.py) imports none of it, and this file imports nothing (`python -m qwen35.bench.host_time` loads
the package first).

    torchrun --nproc-per-node N -m qwen35.bench ...   the bench modes (cli.py)
    python -m qwen35.bench.host_time ...              host time per decode step, on any machine
    python -m qwen35.bench.api_host_time ...          host time per create_engine decode call, on any machine

cli          the command line: modes, tables printed, the results file
args         its flags, and the comma lists they take
results      the results file: header, default path, writing it
step_timer   the engine's step loop timed (an opt-in hook of LLMEngine: engine.timer)
engine_runs  static batches and timed decode steps through LLMEngine
record       the rows of record (runner-level step timings, host time per engine step, kernels per step)
step_timing  runner-level timings: decode and prefill steps, the memory floor, kernel counts
trace        the closed-loop levels of the serving contract, warm and cold
workload     synthetic prompts and output lengths (shared with benchmarks/throughput.py)
latency      one request at a time, optionally beside transformers' generate
harness      the create_engine traces (prefill, decode, mixed, mixed with requests removed and prefilled again)
host_time    host time per decode step without a GPU, split into phases on request
api_host_time  host time per create_engine decode call without a GPU (the decode graphs' host side, no forward)
"""
