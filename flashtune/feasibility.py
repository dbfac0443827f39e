"""Feasibility model: what a variant needs (shared memory, registers) against a target's limits.

It prunes before anything compiles, so it must be cheap and must not prune what would run well.
Shared memory is modelled from Triton's own allocation: metadata.shared of the fwd kernel
compiled through the JIT's warmup (the specialization a real launch gets: 16-byte aligned
pointers and strides, which lets the key loop's loads be multi-buffered), bf16, D=128,
identical on Triton 3.6 and 3.9:

    sm_90, either loads: Q + num_stages * (K + V) (+ <=1 KiB of TMA barriers)
        pointer m128-n64-s1 65536, -s2 98304, -s4 163840; m128-n128-s3 229376;
        m64-n32-s5 98304; descriptor m128-n64-s3 132096, m128-n128-s4 295936
    sm_80, pointer: num_stages * (K + V), plus Q/2 of layout scratch at one stage
        m128-n64-s1 49152, -s2 65536, -s3 98304, -s4 131072; m64-n32-s5 86016

Registers are an estimate (the accumulators live in registers: S = QK^T in float32, P in the
input dtype, the output accumulator in float32, and Q too where the MMA cannot read it from
shared memory, i.e. before wgmma). ptxas caps a thread at min(255, 65536 / threads) registers
and spills beyond; a variant estimated 25% past the cap is pruned as certain to spill.
The compile step still checks the real shared memory (metadata.shared) of what survives.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL_VERSION = 2  # part of the space hash: a new model means new studies
_REG_OVERHEAD = 32   # addresses, m_i/l_i, loop state
_SPILL_MARGIN = 1.25
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Resources:
    smem_bytes: int
    regs_per_thread: int   # estimate
    threads: int


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""      # why not, naming the resource and the limit


OK = Verdict(True)


def dtype_bytes(dtype: str) -> int:
    try:
        return _BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}") from None


def block_d(head_dim: int) -> int:
    """The padded head dim the kernels tile with (as launch.block_d, without importing triton)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _fwd(variant, problem, target) -> Resources:
    e = dtype_bytes(problem.dtype)
    bd = block_d(problem.head_dim)
    q = variant.block_m * bd * e
    kv = 2 * variant.block_n * bd * e
    wgmma = target.has("wgmma")
    stages = max(1, variant.num_stages)
    if variant.loads == "descriptor":
        smem = q + stages * kv + 1024
    elif wgmma:
        smem = q + stages * kv
    else:
        smem = stages * kv + (q // 2 if stages == 1 else 0)
    threads = 32 * variant.num_warps
    s = variant.block_m * variant.block_n
    words = s + s * e // 4 + variant.block_m * bd + (0 if wgmma else variant.block_m * bd * e // 4)
    return Resources(smem, -(-words // threads) + _REG_OVERHEAD, threads)


# family -> resource model; a family without one is pruned by its constraints alone
MODELS = {"fwd": _fwd}


def resources(variant, problem, target) -> Resources | None:
    model = MODELS.get(variant.family)
    return model(variant, problem, target) if model else None


def check(variant, problem, target) -> Verdict:
    """Does `variant` fit `target` for `problem`? (structural features are the space's job)"""
    r = resources(variant, problem, target)
    if r is None:
        return OK
    if r.smem_bytes > target.smem_per_block:
        return Verdict(False, f"shared memory: needs ~{r.smem_bytes} B, {target.short} allows "
                              f"{target.smem_per_block} B per block")
    cap = min(target.max_regs_per_thread, target.regs_per_sm // r.threads)
    if r.regs_per_thread > cap * _SPILL_MARGIN:
        return Verdict(False, f"registers: ~{r.regs_per_thread} per thread, {target.short} allows "
                              f"{cap} at {r.threads} threads (certain to spill)")
    return OK
