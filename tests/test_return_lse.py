"""attention(..., return_lse=True): the float32 row log-sum-exp beside O, equal to the float64
reference's logsumexp of the scaled scores; gradients still flow through O."""
import math

import pytest
import torch

import flashtune

from _check import qkv
from test_backward import assert_grads_match


def ref_lse(q, k, causal, scale=None):
    q64, k64 = q.double(), k.double()
    g = q.shape[1] // k.shape[1]
    k64 = k64.repeat_interleave(g, dim=1)
    s = (q64 @ k64.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_lse_values(causal, grad, device):
    q, k, v = qkv(2, 4, 2, 37, 29, 64, torch.float16, device)  # Nq > Nk: causal rows see nothing
    q.requires_grad_(grad)
    o, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and not lse.requires_grad
    assert torch.equal(o, flashtune.attention(q, k, v, causal=causal))
    ref = ref_lse(q, k, causal)
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse.double()), empty)  # -inf exactly where no key is seen
    err = (lse.double() - ref)[~empty].abs().max().item()
    assert err < 2e-3 * max(1.0, ref[~empty].abs().max().item()), err


def test_gradients_through_o_with_lse(device):
    q, k, v = qkv(1, 2, 1, 33, 40, 32, torch.float16, device)
    assert_grads_match(q, k, v, causal=True)  # the reference's gradients
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = flashtune.attention(*xs, causal=True, return_lse=True)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, xs, do)
    want = torch.autograd.grad(flashtune.attention(*xs, causal=True), xs, do)
    for g, w in zip(got, want):  # deterministic backward: returning the LSE changes nothing
        assert torch.equal(g, w)


def test_return_lse_must_be_bool(device):
    q, k, v = qkv(1, 2, 1, 8, 8, 32, torch.float16, device)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flashtune.attention(q, k, v, return_lse="yes")
