"""The two error measures the kernel tests state their tolerances in."""
import torch


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference, in fp32."""
    return (a.float() - b.float()).abs().max().item()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against the reference b, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
