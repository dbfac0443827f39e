"""How the GPU backend measures the bwd family: inputs, compile-ahead, run, reference.

The same contract as measure_fwd.py (flashtune/measure_gpu.py looks OPS up by family name).
What is timed is the backward alone, launch_bwd.backward on tensors made once per problem:
Q, K, V and dO random normal (never zeros), O and LSE from flashtune's forward (what a real
backward reads). Both dQ schemes go through the same calls; the variant says which kernels run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import launch, launch_bwd
from .accuracy import compare
from .masks import representative
from .measure_fwd import kept_plan, reference_masks
from .defaults import default_variant
from .measure_warmup import compile_only, max_shared
from .problem import Problem, torch_dtype
from .reference import reference, same_dtype_math

_GRADS = ("dq", "dk", "dv")


@dataclass(frozen=True)
class GradReport:
    """The gate's verdict on dQ, dK and dV: each judged on its own (accuracy.compare)."""
    reports: tuple   # (name, ErrorReport) per gradient

    @property
    def ok(self) -> bool:
        return all(r.ok for _, r in self.reports)

    @property
    def max_err(self) -> float:
        return max(r.max_err for _, r in self.reports)

    def __str__(self) -> str:
        bad = [(n, r) for n, r in self.reports if not r.ok]
        return "; ".join(f"{n} {r}" for n, r in (bad or self.reports))


def _grads(fn, q, k, v, do, causal: bool, dtype, kw=None):
    """Gradients of fn's attention in `dtype`, by autograd on copies of the inputs."""
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*xs, causal=causal, **(kw or {})), xs, do.to(dtype))


class BwdOps:
    family = "bwd"

    def __init__(self, device: str = "cuda"):
        self.device = device  # "cpu" runs the same path in Triton's interpreter (tests)

    def shapes(self, p: Problem):
        hk = p.heads // p.group
        return (p.batch, p.heads, p.seqlen_q, p.head_dim), (p.batch, hk, p.seqlen_k, p.head_dim)

    launcher = launch_bwd  # the module that launches the family's variants (launch_hopper_bwd)
    also_launches = ()  # launcher modules its plans load kernels through too (compile_only)

    def compile_ahead(self, variant, p: Problem) -> int:
        """Compile every kernel of the variant for the GPU present without launching, for the
        timed problem and the gate's (as measure_fwd); returns the largest shared memory among
        them (each kernel must fit on its own)."""
        dt = torch_dtype(p.dtype)
        with compile_only(self.launcher, *self.also_launches) as h:
            for gp in dict.fromkeys((p, self.gate_problem(p))):
                qs, ks = self.shapes(gp)
                q, o, do = (torch.empty(qs, dtype=dt, device="meta") for _ in range(3))
                k, v = (torch.empty(ks, dtype=dt, device="meta") for _ in range(2))
                lse = torch.empty(qs[:3], dtype=torch.float32, device="meta")
                self.launcher.backward(do, q, k, v, o, lse, gp.causal, None, variant,
                                       representative(gp, "cpu"))
        return max_shared(h)

    def gate_problem(self, p: Problem) -> Problem:
        """One batch (not a kernel argument); heads, seqlens and head dim as timed, since Triton
        specializes integer arguments on divisibility by 16 (see measure_fwd)."""
        return dataclasses.replace(p, batch=1)

    def _gate_kv_heads(self, p: Problem) -> int:
        # the float64 reference with autograd keeps several N x N tensors per head: check 2 kv
        # heads (and their q heads), one at a time
        return min(p.heads // p.group, 2)

    def inputs(self, p: Problem, seed: int = 0):
        """(q, k, v, o, lse, do): random normal q, k, v, dO; O and LSE from the forward."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        qs, ks = self.shapes(p)
        dt = torch_dtype(p.dtype)
        q, k, v, do = (torch.randn(s, dtype=dt, device=self.device, generator=g)
                       for s in (qs, ks, ks, qs))
        fwd = default_variant("fwd", p.head_dim, p.dtype)
        if fwd.loads == "descriptor" and not (self.device == "cuda" and
                                              torch.cuda.get_device_capability()[0] >= 9):
            fwd = dataclasses.replace(fwd, loads="pointer")
        masks = representative(p, self.device)
        if masks.any:
            from .dispatch import mask_twin
            fwd = mask_twin(fwd, masks, p.head_dim, dt)
        o, lse = launch.forward(q, k, v, p.causal, None, fwd, masks)
        return q, k, v, o, lse, do

    def plan(self, variant, p: Problem, inputs):
        q, k = inputs[:2]
        return self.launcher.plan(q, k, p.causal, None, variant, representative(p, q.device.type))

    def run(self, variant, p: Problem, inputs):
        q, k, v, o, lse, do = inputs
        return kept_plan(self, variant, p, inputs).run(do, q, k, v, o, lse)

    def gate_view(self, out, p: Problem):
        hk = self._gate_kv_heads(p)
        dq, dk, dv = out
        return dq[:, :hk * p.group], dk[:, :hk], dv[:, :hk]

    def reference(self, p: Problem, inputs):
        """Per gradient: (float64 reference, PyTorch's same-dtype math), of the heads gate_view
        keeps, from autograd on copies (float64, and the input dtype)."""
        q, k, v, _, _, do = inputs
        g = p.group
        kw = reference_masks(p, q.device.type)
        if kw.get("mask") is not None and kw["mask"].shape[1] > 1:  # per-head masks: not sliced
            raise ValueError("per-head block masks are not gated here")
        parts = []
        for j in range(self._gate_kv_heads(p)):  # one kv head at a time: memory, not speed
            qs, ks, dos = slice(j * g, (j + 1) * g), slice(j, j + 1), slice(j * g, (j + 1) * g)
            args = (q[:, qs], k[:, ks], v[:, ks], do[:, dos], p.causal)
            parts.append((_grads(reference, *args, torch.float64, kw),
                          _grads(same_dtype_math, *args, q.dtype, kw)))
        ref = tuple(torch.cat([r[i] for r, _ in parts], dim=1) for i in range(3))
        base = tuple(torch.cat([b[i] for _, b in parts], dim=1) for i in range(3))
        return tuple(zip(ref, base))

    def check(self, out, p: Problem, ref) -> GradReport:
        """dQ, dK and dV each within DESIGN.md's tolerance of the float64 reference."""
        views = self.gate_view(out, p)
        return GradReport(tuple((n, compare(x, r, b)) for n, x, (r, b) in zip(_GRADS, views, ref)))


OPS = BwdOps()
