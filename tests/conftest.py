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

# Gluon imported now, under the knob above: triton 3.9's Gluon asserts at import that
# triton.language's functions are JIT functions unless interpreting, so a first import inside a
# test that sets TRITON_INTERPRET=0 (a dispatcher test acting as a GPU machine) failed, and such
# tests passed or failed by which test imported Gluon first
try:
    import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
except Exception:  # noqa: BLE001 -- a Triton without Gluon: gluon_compat.missing() says so
    pass


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
