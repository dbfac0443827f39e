"""Shared benchmark plumbing: the standard grid, FLOPs, timing, peers, result files."""
from __future__ import annotations

import json
import os
import platform

import torch
import triton

# FA2/FA3 papers' grid: B*N = 16k tokens, hidden 2048 (H=32 at D=64, H=16 at D=128)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def standard_grid(head_dims=(64, 128), seqlens=SEQLENS, causals=(False, True)):
    for d in head_dims:
        for causal in causals:
            for n in seqlens:
                yield dict(B=16384 // n, H=2048 // d, N=n, D=d, causal=causal)


def fwd_flops(B, H, N, D, causal, Nk=None):
    f = 4.0 * B * H * N * (Nk or N) * D
    return f / 2 if causal else f


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Median of repeated runs; do_bench flushes L2 between runs."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def sdpa_fn(backend_name, q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


class Results:
    """JSONL under $OUT (or ./bench_out) plus a printed table at the end."""

    def __init__(self, name: str):
        out = os.environ.get("OUT") or "bench_out"
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, f"{name}.jsonl")
        self.f = open(self.path, "w")
        self.write({"kind": "env", **environment()})

    def write(self, row: dict):
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
