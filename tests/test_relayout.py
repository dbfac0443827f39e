"""relayout.copy_: (B, H, N, D) tensors copied between memory layouts by one Triton kernel (the
Hopper plans' mixed-layout calls), against torch's own copy, bit for bit; bad input named."""
import pytest
import torch

from flashtune import relayout


def _views(b, h, n, d, dtype, device):
    bhnd = torch.randn(b, h, n, d, dtype=dtype, device=device)
    bnhd = torch.randn(b, n, h, d, dtype=dtype, device=device).transpose(1, 2)
    wide = torch.randn(b, n, 3, h, d, dtype=dtype, device=device).unbind(2)[1].transpose(1, 2)
    return bhnd, bnhd, wide


@pytest.mark.parametrize("shape", [(2, 3, 70, 64), (1, 4, 5, 128), (3, 1, 130, 96)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_copies_between_layouts_exactly(shape, dtype, device, monkeypatch):
    launches = []
    real = relayout.Launcher.__call__
    monkeypatch.setattr(relayout.Launcher, "__call__",
                        lambda self, *a: launches.append(1) or real(self, *a))
    views = _views(*shape, dtype, device)
    for src in views:
        for dst in _views(*shape, dtype, device):
            out = relayout.copy_(dst, src)
            assert out is dst and out.stride() == dst.stride() and torch.equal(out, src)
    rows = relayout.rows_copy(views[0])
    assert torch.equal(rows, views[0]) and rows.transpose(1, 2).is_contiguous()
    like = relayout.like_copy(views[0], views[1])
    assert torch.equal(like, views[1]) and like.is_contiguous()
    if device == "cuda" or relayout.interpreting():  # the kernel's, not torch's copy
        assert len(launches) == 11


def test_bad_input_names_what_was_expected():
    a = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        relayout.copy_(a, torch.randn(2, 3, 4, 16))
    with pytest.raises(ValueError, match="one shape and dtype"):
        relayout.copy_(a, a.half())
