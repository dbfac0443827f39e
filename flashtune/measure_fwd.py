"""How the GPU backend measures the fwd family: inputs, compile-ahead, run, reference.

A family plugs into the search with an object like OPS here (flashtune/measure_gpu.py looks
it up by family name in GpuBackend.family_modules).
"""
from __future__ import annotations

import dataclasses

import torch

from . import alloc, launch
from .accuracy import compare
from .masks import representative
from .measure_warmup import compile_only, max_shared
from .problem import Problem, torch_dtype
from .reference import reference, same_dtype_math


def kept_plan(ops, variant, p: Problem, inputs, keep: int = 16):
    """ops.plan(variant, p, inputs), built on the first run of (variant, problem, inputs) and
    kept, as ops.run_forward / run_backward memoize a real call's: the timed runs are the
    launches alone. Building a plan per run (a Gluon plan's layouts, the grids, the mask
    arguments) costs the host more than the L2 flush before each run gives it, which put host
    time into short kernels' timings (docs/benchmarks.md, session 11). keep: how many plans
    to hold before starting over (a few problems' worth: the search moves on bucket by
    bucket; splitkv keeps more, since a CUDA-graphed timing replays its plan's buffers)."""
    plans = ops.__dict__.setdefault("_plans", {})
    key = (variant, p, inputs[0].data_ptr(), inputs[0].device.type)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= keep:
            plans.clear()
        plan = plans[key] = ops.plan(variant, p, inputs)
    return plan


class FwdOps:
    family = "fwd"

    def shapes(self, p: Problem):
        hk = p.heads // p.group
        return (p.batch, p.heads, p.seqlen_q, p.head_dim), (p.batch, hk, p.seqlen_k, p.head_dim)

    launcher = launch  # the module that launches the family's variants (hopper_fwd: launch_hopper)

    def compile_ahead(self, variant, p: Problem) -> int:
        """Compile for the GPU present without launching, the binaries the timing worker's
        launches will look up in Triton's cache (the timed problem's and the gate's: an integer
        argument's divisibility by 16 may differ between them); returns the kernels' largest
        shared memory. Each kernel[grid](...) the launcher makes is the JIT's warm-up: meta
        tensors (a Gluon plan's TMA descriptors take them as their base) and no context."""
        dt = torch_dtype(p.dtype)
        with compile_only(self.launcher) as h:
            for gp in dict.fromkeys((p, self.gate_problem(p))):
                qs, ks = self.shapes(gp)
                q = torch.empty(qs, dtype=dt, device="meta")
                k = torch.empty(ks, dtype=dt, device="meta")
                self.launcher.forward(q, k, alloc.empty_like(k), gp.causal, None, variant,
                                      representative(gp, "cpu"))
        return max_shared(h)

    def gate_problem(self, p: Problem) -> Problem:
        """A smaller problem that runs the very binary that is timed: one batch (not a kernel
        argument); heads, seqlens and head dim as timed, since Triton specializes integer
        arguments on divisibility by 16 and a different H or N would compile another kernel."""
        return dataclasses.replace(p, batch=1)

    def _gate_heads(self, p: Problem) -> int:
        # the float64 reference of every head at N=16k would need tens of GB: check 2 kv heads
        return min(p.heads, 2 * p.group)

    def gate_view(self, out, p: Problem):
        return out[:, :self._gate_heads(p)]

    def check(self, out, p: Problem, ref):
        """The gate's verdict (.ok, .max_err, str) on run()'s output against reference()'s."""
        return compare(self.gate_view(out, p), *ref)

    def inputs(self, p: Problem, seed: int = 0):
        """Random normal q, k, v (never zeros: zeros hide masking and scaling bugs)."""
        g = torch.Generator(device="cuda").manual_seed(seed)
        qs, ks = self.shapes(p)
        dt = torch_dtype(p.dtype)
        return tuple(torch.randn(s, dtype=dt, device="cuda", generator=g) for s in (qs, ks, ks))

    def plan(self, variant, p: Problem, inputs):
        q, k, v = inputs
        return launch.FwdPlan(q, k, v, p.causal, None, variant, representative(p, q.device.type))

    def run(self, variant, p: Problem, inputs):
        q, k, v = inputs
        return kept_plan(self, variant, p, inputs).run(q, k, v)[0]

    def reference(self, p: Problem, inputs):
        """Float64 reference and PyTorch's same-dtype math, of the heads gate_view keeps."""
        h = self._gate_heads(p)
        q, k, v = inputs
        q, k, v = q[:, :h], k[:, :h // p.group], v[:, :h // p.group]
        kw = reference_masks(p, q.device.type)
        return (reference(q, k, v, causal=p.causal, **kw),
                same_dtype_math(q, k, v, causal=p.causal, **kw))


def reference_masks(p: Problem, device: str) -> dict:
    """The reference's keyword arguments for a masked problem's representative masks."""
    m = representative(p, device)
    if not m.any:
        return {}
    return dict(window=m.window, softcap=m.softcap,
                mask=None if m.block_mask is None else m.block_mask.to_dense_mask())


OPS = FwdOps()
