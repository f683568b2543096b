import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels (QWEN35_KERNELS=fast) run through Triton's interpreter; it must be chosen before
# triton is first imported. Its fp32 -> bf16 casts truncate, so interpreter checks compare in fp32.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- shared fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A model cache of the test module's own ($QWEN35_CACHE while the module runs)."""
    with pytest.MonkeyPatch.context() as mp:
        d = str(tmp_path_factory.mktemp("qwen35-cache"))
        mp.setenv("QWEN35_CACHE", d)
        yield d


@pytest.fixture(scope="module")
def tiny_dir(cache_dir):
    """The `tiny` preset's synthetic checkpoint (a module may define its own tiny_dir instead)."""
    from qwen35.hub import resolve_model
    return resolve_model("tiny")
