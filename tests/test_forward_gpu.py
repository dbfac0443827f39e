"""GPU-only forward checks: bfloat16 (wrong in the interpreter), long sequences, TMA variants."""
import pytest
import torch

import flashtune

from _check import assert_matches_reference, qkv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d", [(1, 1, 64), (17, 17, 128), (113, 203, 80), (1023, 1024, 64),
                                     (203, 113, 256), (777, 1500, 96)])
def test_dtypes_shapes(nq, nk, d, causal, dtype):
    assert_matches_reference(*qkv(2, 4, 2, nq, nk, d, dtype, "cuda"), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", [(4096, 128), (8192, 64), (16384, 128)])
def test_long_sequences(n, d, causal):
    assert_matches_reference(*qkv(1, 2, 1, n, n, d, torch.bfloat16, "cuda"), causal=causal)


@pytest.mark.parametrize("name", ["fwd-m128-n64-w8-s3-loads=descriptor",
                                  "fwd-m128-n128-w8-s2-causal_split=false-loads=descriptor",
                                  "fwd-m64-n64-w4-s4", "fwd-m128-n32-w4-s3-causal_split=false"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_structural_variants_gpu(name, dtype, causal):
    q, k, v = qkv(2, 4, 1, 300, 517, 128, dtype, "cuda", layout="bnhd")
    with flashtune.force(name):
        assert_matches_reference(q, k, v, causal=causal)


def test_float32_full_precision():
    q, k, v = qkv(1, 2, 2, 129, 257, 64, torch.float32, "cuda")
    out = flashtune.attention(q, k, v)
    ref = flashtune.reference(q, k, v)
    assert (out.double() - ref).abs().max().item() < 1e-5  # tf32 would be ~1e-3
