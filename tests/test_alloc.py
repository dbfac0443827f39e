"""flashtune/alloc.py: outputs in their input's layout as torch.empty_like allocates them (ATen's
preserve_format), without torch's meta reference, which imports sympy: the layouts agree with
torch's on CPU tensors, and a compile-ahead of every family on meta tensors (kernels stood in for,
as tests/test_search_hopper.py does) imports no sympy in a fresh process."""
from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

from flashtune import alloc


def _layouts():
    """CPU tensors of many layouts: contiguous, permuted, with size-1 and size-0 dims, sliced
    (gaps), expanded (overlaps), transposed views of (B, N, H, D)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in ((2, 3, 5, 4), (1, 3, 1, 4), (2, 1, 7, 8), (3, 4), (5,), (1,), (2, 0, 3)):
        base = torch.randn(shape, generator=g)
        for perm in itertools.permutations(range(len(shape))):
            out.append(base.permute(perm))  # a view: strides permuted
            out.append(base.permute(perm).contiguous())
    x = torch.randn(4, 6, 8, generator=g)
    out += [x[:, ::2], x[..., 1:5], x[:, :, ::3].transpose(0, 2), x[:1].expand(3, 6, 8),
            torch.randn(2, 5, 3, 8, generator=g).transpose(1, 2),  # (B, N, H, D) as (B, H, N, D)
            torch.randn(8, generator=g).expand(4, 8)]
    return out


def test_like_strides_are_torch_empty_likes():
    for t in _layouts():
        want = torch.empty_like(t).stride()  # ATen's preserve_format, as forward() allocates
        assert alloc.like_strides(t) == want, (tuple(t.shape), t.stride())
        m = alloc.meta_like(t)
        assert m.device.type == "meta" and m.shape == t.shape and m.stride() == want


def test_dense_is_atens_non_overlapping_and_dense():
    def brute(t):  # every element hit exactly once by the offsets of a dense block
        if t.numel() == 0:
            return True
        offs = sorted(sum(i * s for i, s in zip(idx, t.stride()))
                      for idx in itertools.product(*map(range, t.shape)))
        return offs == list(range(offs[0], offs[0] + len(offs))) and offs[0] == 0
    for t in _layouts():
        if t.numel():
            assert alloc.dense(t.shape, t.stride()) == brute(t), (tuple(t.shape), t.stride())


def test_empty_and_zeros_like_keep_the_layout_on_meta_and_real_tensors():
    q = torch.randn(2, 5, 3, 8).transpose(1, 2)  # (B, H, N, D) view of (B, N, H, D)
    for t in (q, q.to("meta")):
        e = alloc.empty_like(t)
        z = alloc.zeros_like(t)
        assert e.stride() == z.stride() == torch.empty_like(q).stride()
        assert e.device == t.device and e.dtype == t.dtype
        assert alloc.empty_like(t, torch.float32).dtype == torch.float32
    assert torch.count_nonzero(alloc.zeros_like(q)) == 0


_PROBE = textwrap.dedent('''
    import sys
    from types import SimpleNamespace
    import torch
    from flashtune import (launch, launch_bwd, launch_hopper, launch_hopper_bwd, launch_splitkv,
                           measure_bwd, measure_fwd, measure_hopper, measure_hopper_bwd,
                           measure_splitkv)
    from flashtune.codegen import Variant
    from flashtune.defaults import default_variant
    from flashtune.problem import Problem

    class Jit:
        def warmup(self, *args, grid, **kw):
            assert not any(isinstance(a, torch.Tensor) for a in args)
            return SimpleNamespace(metadata=SimpleNamespace(shared=1))

    class Module:
        def __getattr__(self, name):
            return Jit()
    for mod in (launch, launch_bwd, launch_hopper, launch_hopper_bwd, launch_splitkv):
        mod.load = lambda v: Module()
    fwd = Problem("fwd", "bfloat16", 128, True, 2, 4, 2, 300, 300)
    bwd = Problem("bwd", "bfloat16", 128, True, 2, 4, 2, 300, 300)
    sk = Problem("splitkv", "bfloat16", 128, False, 2, 4, 2, 1, 2048)
    runs = [(measure_fwd.OPS, default_variant("fwd", 128, "bfloat16"), fwd),
            (measure_bwd.BwdOps(), default_variant("bwd", 128, "bfloat16", dq="separate"), bwd),
            (measure_bwd.BwdOps(), default_variant("bwd", 128, "bfloat16", dq="atomic"), bwd),
            (measure_splitkv.OPS, default_variant("splitkv", 128, "bfloat16"), sk)]
    if GLUON:
        runs += [(measure_hopper.OPS, Variant.parse(
                     "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"), fwd),
                 (measure_hopper_bwd.OPS, Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon"), bwd),
                 (measure_hopper_bwd.OPS, Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=separate"),
                  bwd)]
    for ops, v, p in runs:
        assert ops.compile_ahead(v, p) > 0, v.name
    print("sympy" in sys.modules, len(runs))
''')


def test_a_compile_ahead_of_every_family_imports_no_sympy():
    """A search's compile worker builds each trial's plans on meta tensors: with
    flashtune/alloc.py none of them reaches torch's meta reference of empty_like (sympy: 0.3 s
    here, the first seconds of a compile worker's start on the device)."""
    from flashtune.gluon_compat import missing
    code = f"GLUON = {not missing()}\n" + _PROBE
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    imported, n = r.stdout.split()[-2:]
    assert imported == "False" and int(n) >= 4, r.stdout
