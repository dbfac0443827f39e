"""A repeated masked call's host path (issue 11): after the first call of a signature, a masked
forward + backward through flashtune.attention and autograd does what a dense one does -- a memo
lookup, the buffers and the launches -- and no dispatcher lookup, no plan or block-mask index
rebuild, no device->host read of a tensor's values. Counted, not timed (the H100 measured
~0.8 ms of host time per masked fwd+bwd against ~0.3 ms of kernels before: bench/
mask_host_overhead.py and STEPS=sparseprof time it)."""
import sys
from pathlib import Path

import pytest
import torch

import flashtune
from flashtune import block_mask, dispatch, launch, launch_bwd, ops

from _check import qkv

FLASHTUNE = str(Path(flashtune.__file__).parent)
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "any", "all")


class Counter:
    """Counts calls of the patched functions, and tensor value reads made by flashtune's code."""

    def __init__(self, monkeypatch):
        self.calls: dict = {}
        self._mp = monkeypatch

    def wrap(self, owner, name, label=None):
        real = getattr(owner, name)
        label = label or name

        def counted(*a, **kw):
            self.calls[label] = self.calls.get(label, 0) + 1
            return real(*a, **kw)
        self._mp.setattr(owner, name, counted)

    def watch_syncs(self):
        for name in SYNCS:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, _name=name, **kw):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(FLASHTUNE):  # flashtune's own code, not the interpreter's
                    key = f"Tensor.{_name}"
                    self.calls[key] = self.calls.get(key, 0) + 1
                return _real(t, *a, **kw)
            self._mp.setattr(torch.Tensor, name, read)
        real_equal = torch.equal

        def equal(a, b):
            if sys._getframe(1).f_code.co_filename.startswith(FLASHTUNE):
                self.calls["torch.equal"] = self.calls.get("torch.equal", 0) + 1
            return real_equal(a, b)
        self._mp.setattr(torch, "equal", equal)

    def take(self) -> dict:
        out, self.calls = self.calls, {}
        return out


def _masks(kind, n, device):
    nb = n // 16
    blocks = torch.rand(nb, nb, device=device) < 0.5
    blocks |= torch.eye(nb, dtype=torch.bool, device=device)  # every query row keeps a block
    if kind == "window":
        return dict(causal=True, window=(20, 0))
    if kind == "softcap":
        return dict(softcap=5.0)
    if kind == "block":
        return dict(block_mask=flashtune.BlockMask.from_dense(blocks, (n, n), block_size=16))
    elem = torch.rand(n, n, device=device) < 0.7
    return dict(causal=True, window=(24, 8), softcap=5.0,
                block_mask=flashtune.BlockMask.from_dense(blocks, (n, n), block_size=16,
                                                          mask=elem))


@pytest.mark.parametrize("kind", ["window", "softcap", "block", "block+elem+window+softcap"])
def test_a_repeated_masked_call_rebuilds_nothing(kind, device, monkeypatch):
    n = 48
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, n, n, 16, torch.float16, device))
    g = torch.randn_like(q)
    kw = _masks(kind, n, device)
    dispatch.clear_cache()  # the first call below builds every plan
    c = Counter(monkeypatch)
    c.wrap(dispatch, "select_for_call")
    c.wrap(dispatch, "mask_twin")
    c.wrap(ops, "select_bwd")
    c.wrap(launch.FwdPlan, "__init__", "FwdPlan")
    c.wrap(launch_bwd.BwdPlan, "__init__", "BwdPlan")
    c.wrap(launch_bwd, "kernel_params")
    c.wrap(block_mask, "_lists")
    c.wrap(block_mask.BlockMask, "from_op_args")
    c.wrap(block_mask.BlockMask, "density")
    c.watch_syncs()

    def step():
        out = flashtune.attention(q, k, v, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    first = step()
    built = c.take()
    # the counters see the first call's work (else the zeros below would prove nothing)
    assert built.get("select_for_call") and built.get("select_bwd"), built
    assert built.get("FwdPlan") and built.get("BwdPlan") and built.get("kernel_params"), built
    second = step()
    assert c.take() == {}  # no lookup, no plan, no index list, no value read
    for a, b in zip(first, second):
        assert torch.equal(a, b)  # and the same results


def test_block_mask_checks_stay_before_any_launch(device):
    # the memoized fit check still refuses a call the mask does not fit, before any launch
    n = 32
    q, k, v = qkv(1, 2, 1, n, n, 16, torch.float16, device)
    bm = flashtune.BlockMask.from_dense(torch.ones(2, 2, dtype=torch.bool, device=device),
                                        (n, n), block_size=16)
    flashtune.attention(q, k, v, block_mask=bm)
    q2, k2, v2 = qkv(1, 2, 1, n + 16, n + 16, 16, torch.float16, device)
    with pytest.raises(ValueError, match="block_mask was built for seq_lengths"):
        flashtune.attention(q2, k2, v2, block_mask=bm)
    hb = flashtune.BlockMask.from_dense(torch.ones(3, 2, 2, dtype=torch.bool, device=device),
                                        (n, n), block_size=16)
    with pytest.raises(ValueError, match="block_mask has \\(batch, heads\\)"):
        flashtune.attention(q, k, v, block_mask=hb)


@pytest.mark.parametrize("window", [None, (5, 3)])
def test_a_repeated_varlen_backward_rebuilds_nothing(window, device, monkeypatch):
    # the layers of a packed training step: the varlen backward's plan is built once per call
    # signature too, the offsets checked once per offsets tensor
    lens = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(19, 2, 16, dtype=torch.float16, device=device).requires_grad_()
               for _ in range(3))
    g = torch.randn_like(q)
    kw = {} if window is None else {"window": window}
    dispatch.clear_cache()
    c = Counter(monkeypatch)
    c.wrap(dispatch, "select_varlen")
    c.wrap(launch_bwd.BwdPlan, "__init__", "BwdPlan")
    c.wrap(launch_bwd, "kernel_params")
    c.watch_syncs()

    def step():
        out = flashtune.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    first = step()
    built = c.take()
    assert built.get("select_varlen") and built.get("BwdPlan") and built.get("kernel_params"), built
    second = step()
    assert c.take() == {}  # no lookup, no plan, no value read
    for a, b in zip(first, second):
        assert torch.equal(a, b)
