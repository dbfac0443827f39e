"""How the GPU backend measures the splitkv family (the same contract as measure_fwd.py): a
decode step over a contiguous KV cache, every sequence at the bucket's key count, random
inputs, gated against the float64 reference of the equivalent dense problem. A masked
problem (window, softcap) runs and is gated with its representative masks (masks.py), as the
fwd family's."""
from __future__ import annotations

import dataclasses

import torch

from . import alloc, launch_splitkv
from .accuracy import compare
from .masks import representative
from .measure_fwd import kept_plan, reference_masks
from .measure_warmup import compile_only, max_shared
from .problem import Problem, torch_dtype
from .reference import reference, same_dtype_math


class SplitKVOps:
    family = "splitkv"
    # a decoding step takes microseconds: timed as CUDA-graph replays (timing.graphed), as
    # serving runs it; timed call by call, Python's launch latency decided the pick
    graphed = True
    # ... and as a step of up to LAYERS layers, each reading its own cache, per layer (as
    # `flashtune bench --section decode` times every peer, and as a model's step runs). One call
    # alone, after the L2 flush, timed its launch and the flush's write-back beside its reads:
    # on the H100 the search read MQA B=1 32k keys at 1,034 GB/s where the bench's 16-layer step
    # reads the same kernel at 1,317 (GQA B=1 32k: 2,174 against 2,646), and its pick for MQA
    # B=8 32k ran 2.4% under the built-in default in the bench (docs/benchmarks.md, session
    # 31). STEP_BYTES caps the step's caches (fewer layers where they would pass it; one layer
    # where one passes it)
    LAYERS = 16
    STEP_BYTES = 8 << 30

    def __init__(self, device: str = "cuda"):
        self.device = device  # "cpu" runs the same path in Triton's interpreter (tests)

    def shapes(self, p: Problem):
        """q (B, Nq, H, D) and the caches (B, Nk, Hk, D): flash_attn_with_kvcache's layout."""
        return ((p.batch, p.seqlen_q, p.heads, p.head_dim),
                (p.batch, p.seqlen_k, p.heads // p.group, p.head_dim))

    def plan(self, variant, p: Problem, inputs):
        q, k = inputs[:2]
        return launch_splitkv.SplitKVPlan(q, k, p.causal, None, variant,
                                          representative(p, q.device.type))

    def compile_ahead(self, variant, p: Problem) -> int:
        qs, ks = self.shapes(p)
        dt = torch_dtype(p.dtype)
        q = torch.empty(qs, dtype=dt, device="meta")
        k = torch.empty(ks, dtype=dt, device="meta")
        seqlens = torch.empty(p.batch, dtype=torch.int32, device="meta")
        with compile_only(launch_splitkv) as h:
            # built afresh: a plan made under compile_only holds its warm-up kernels
            self.plan(variant, p, (q, k)).run(q, k, alloc.empty_like(k), seqlens, None, p.seqlen_k)
        return max_shared(h)

    def gate_problem(self, p: Problem) -> Problem:
        # batch is not a kernel argument, but it changes the auto split count: keep 2 sequences
        return dataclasses.replace(p, batch=min(p.batch, 2))

    def inputs(self, p: Problem, seed: int = 0):
        g = torch.Generator(device=self.device).manual_seed(seed)
        qs, ks = self.shapes(p)
        dt = torch_dtype(p.dtype)
        q, k, v = (torch.randn(s, dtype=dt, device=self.device, generator=g)
                   for s in (qs, ks, ks))
        seqlens = torch.full((p.batch,), p.seqlen_k, dtype=torch.int32, device=self.device)
        return q, k, v, seqlens

    def layers(self, p: Problem) -> int:
        """Layers of the timed step (the interpreter: one; its timings mean nothing)."""
        if self.device != "cuda":
            return 1
        from .feasibility import dtype_bytes
        _, ks = self.shapes(p)
        one = 2 * ks[0] * ks[1] * ks[2] * ks[3] * dtype_bytes(p.dtype)
        return max(1, min(self.LAYERS, self.STEP_BYTES // one))

    def step_inputs(self, p: Problem, seed: int = 0):
        """q, seqlens and each layer's caches: (q, (k per layer), (v per layer), seqlens)."""
        q, k, v, seqlens = self.inputs(p, seed)
        g = torch.Generator(device=self.device).manual_seed(seed + 7919)
        more = [torch.randn(k.shape, dtype=k.dtype, device=self.device, generator=g)
                for _ in range(2 * (self.layers(p) - 1))]
        return q, (k, *more[0::2]), (v, *more[1::2]), seqlens

    def step(self, variant, p: Problem, inputs):
        """Every layer's decode step in turn (one plan: the layers share their shapes); the last
        layer's output."""
        q, ks, vs, seqlens = inputs
        plan = kept_plan(self, variant, p, (q, ks[0]), keep=256)
        for k, v in zip(ks, vs):
            out = plan.run(q, k, v, seqlens, None, p.seqlen_k)[0]
        return out

    def run(self, variant, p: Problem, inputs):
        q, k, v, seqlens = inputs
        # a timed call must not pay for building its plan (kept_plan); 256 kept: a graphed
        # timing replays its plan's buffers
        return kept_plan(self, variant, p, inputs, keep=256).run(q, k, v, seqlens, None,
                                                                 p.seqlen_k)[0]

    def _gate_heads(self, p: Problem) -> int:
        return min(p.heads, 2 * p.group)

    def gate_view(self, out, p: Problem):
        return out[:, :, :self._gate_heads(p)].transpose(1, 2)

    def reference(self, p: Problem, inputs):
        h = self._gate_heads(p)
        q, k, v, _ = inputs
        q, k, v = (t.transpose(1, 2) for t in (q[:, :, :h], k[:, :, :h // p.group],
                                               v[:, :, :h // p.group]))
        kw = reference_masks(p, q.device.type)
        return (reference(q, k, v, causal=p.causal, **kw),
                same_dtype_math(q, k, v, causal=p.causal, **kw))

    def check(self, out, p: Problem, ref):
        return compare(self.gate_view(out, p), *ref)


OPS = SplitKVOps()
