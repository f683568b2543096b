"""`python -m qwen35.bench` / `torchrun --nproc-per-node N -m qwen35.bench`: the command line of cli.py."""
from qwen35.bench.cli import main

main()
