"""Forward attention against the float64 reference (interpreter on the CPU, the GPU when present)."""
import pytest
import torch

import flashtune
from flashtune.codegen import Variant

from _check import assert_matches_reference, qkv

DTYPES = [torch.float16, torch.float32]
SHAPES = [(1, 1), (17, 17), (113, 203), (203, 113), (64, 64), (1, 130)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_shapes(nq, nk, causal, dtype, device):
    assert_matches_reference(*qkv(2, 2, 2, nq, nk, 64, dtype, device), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_long_awkward(causal, device):
    # 1023x1024: tails on both sides, several key blocks, diagonal off by one
    assert_matches_reference(*qkv(1, 1, 1, 1023, 1024, 32, torch.float16, device), causal=causal)


@pytest.mark.parametrize("d", [16, 48, 80, 96, 128, 160, 192, 256])
def test_head_dims(d, device):
    assert_matches_reference(*qkv(1, 2, 1, 37, 70, d, torch.float16, device), causal=True)


@pytest.mark.parametrize("h,hk", [(4, 2), (6, 1), (8, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(h, hk, causal, device):
    q, k, v = qkv(2, h, hk, 33, 47, 64, torch.float16, device)
    before = (k.data_ptr(), v.data_ptr())
    assert_matches_reference(q, k, v, causal=causal)
    assert (k.data_ptr(), v.data_ptr()) == before


def test_transposed_layout_no_copy(device):
    q, k, v = qkv(2, 3, 3, 45, 61, 64, torch.float16, device, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = assert_matches_reference(q, k, v, causal=True)
    assert out.stride() == q.stride()  # the output keeps the caller's (B, N, H, D) layout


def test_non_dense_strides(device):
    base = torch.randn(2, 4, 50, 96, dtype=torch.float16, device=device)
    q = base[:, ::2, :, :64]          # strided heads, head dim sliced: strides (19200, 9600, 96, 1)
    k = base[:, 1::2, 5:45, 32:]
    v = torch.randn(2, 2, 40, 64, dtype=torch.float16, device=device)
    assert_matches_reference(q, k, v)


def test_custom_scale(device):
    assert_matches_reference(*qkv(1, 2, 2, 31, 29, 64, torch.float16, device), scale=0.3)


def test_query_rows_that_see_no_key_are_zero(device):
    # Nq > Nk, causal bottom-right: the first Nq - Nk rows see nothing
    q, k, v = qkv(1, 2, 2, 40, 10, 32, torch.float32, device)
    out = assert_matches_reference(q, k, v, causal=True)
    assert torch.all(out[:, :, :30] == 0)
    assert torch.all(out[:, :, 30:].abs().sum(-1) > 0)


def test_causal_equals_sdpa_when_square(device):
    q, k, v = qkv(1, 2, 2, 65, 65, 32, torch.float32, device)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = flashtune.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=1e-4)


def test_lse_matches_reference(device):
    from flashtune.api import forward
    from flashtune.reference import reference
    q, k, v = qkv(1, 2, 1, 50, 77, 64, torch.float32, device)
    _, lse = forward(q, k, v, True, None)
    _, ref_lse = reference(q, k, v, causal=True, return_lse=True)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double().cpu(), ref_lse.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [
    "fwd-m32-n16-w4-s2",
    "fwd-m32-n32-w4-s2-causal_split=false",
    "fwd-m64-n32-w4-s2-loads=descriptor",
    "fwd-m16-n64-w2-s1-causal_split=false-loads=descriptor",
])
@pytest.mark.parametrize("causal", [False, True])
def test_structural_variants(name, causal, device):
    q, k, v = qkv(1, 2, 1, 97, 75, 80, torch.float16, device)
    with flashtune.force(name) as variant:
        assert isinstance(variant, Variant)
        assert_matches_reference(q, k, v, causal=causal)


def test_empty_inputs(device):
    q, k, v = qkv(0, 2, 2, 8, 8, 32, torch.float16, device)
    assert flashtune.attention(q, k, v).shape == (0, 2, 8, 32)
    q, k, v = qkv(1, 2, 2, 0, 8, 32, torch.float16, device)
    assert flashtune.attention(q, k, v).shape == (1, 2, 0, 32)
    q, k, v = qkv(1, 2, 2, 5, 0, 32, torch.float16, device)
    out = flashtune.attention(q, k, v)
    assert out.shape == (1, 2, 5, 32) and torch.all(out == 0)
