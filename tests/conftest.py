"""Test setup: kernels run in Triton's interpreter on machines without a GPU."""
import os
import tempfile
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# must be set before triton is imported (it reads the knob when kernels are defined)
os.environ.setdefault("TRITON_INTERPRET", "0" if HAS_CUDA else "1")
os.environ.setdefault("FLASHTUNE_CACHE_DIR", tempfile.mkdtemp(prefix="flashtune-test-cache-"))
os.environ.pop("FLASHTUNE_FORCE_VARIANT", None)
os.environ.pop("FLASHTUNE_DB", None)

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh random inputs per test, reproducible from the test's name
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def reset_dispatch():
    """Unpin any forced variant and drop the dispatcher's configuration after the test."""
    yield
    import flashtune
    from flashtune import dispatch
    flashtune.force(None)
    dispatch.configure()
