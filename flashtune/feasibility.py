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

bwd has two main kernels, each of which must fit on its own: attn_bwd_dkdv (K, V of BLOCK_N
keys held, Q and dO of BLOCK_M rows streamed) and, for dq="separate", attn_bwd_dq (Q, dO of
BLOCK_M2 rows held, K and V of BLOCK_N2 keys streamed). Calibrated on ~600 kernels compiled for
sm_90 and sm_80 on the CPU (triton.compile of an ASTSource with the 16-byte divisibility a real
launch gets, as bench/bwd_compile_check.py; ptxas -v for registers and spills), bf16, D=64/128,
causal, Triton 3.9. Where the MMA has 64+ rows (wgmma: BLOCK_N for dK/dV, BLOCK_M2 for dQ) every
stage is a buffer; below that (mma.sync, and every sm_80 kernel) one stage lives in registers
and the [M, N] tile of P goes through shared memory:

    sm_90 D=128 dK/dV separate m64-n64-w8-s2 99328 (model 99328), m32-n128-w8-s2 98560 (98816);
        atomic m32-n128-w8-s2 139520 (147968), m128-n64-w8-s4 363520 (331776: pruned either way)
    sm_90 D=128 dQ m128-n64-w8-s2 131072 (131072), m64-n128-w4-s4 294912 (294912)
    sm_90 D=64 dK/dV separate m128-n64-w8-s4 150528 (151552); atomic m32-n128-w8-s3 82432 (82688)
    sm_80 D=128 dK/dV separate m64-n64-w8-s3 107520 (107520); atomic m32-n64-w8-s3 82432 (86528)

With two or more stages the model is within -14%..+30% of Triton (median 0), the worst over-
estimates being small atomic tiles far below the limit; at one stage it under-estimates (up to
-75% at m128-n32: layout scratch), which the compile step catches. Registers: ptxas used ~40-75
more than the tile words below; with _BWD_REG_OVERHEAD = 56 and the 25% margin, every variant
pruned for registers in the calibration set spilled, and every sm_90 one that spilled over 1 KB
(e.g. D=128 with num_warps=4 and BLOCK_N=128) was pruned (let through: sm_80 D=64 m128-n64-w8-s1,
1-20 KB of spills, which the timings then rank low). The one over-prune: sm_80 D=128 atomic
m64-n128-w8-s3 (164864 B real, which spills 1 KB anyway). float32 (PRECISE: S and dP in float64)
is under-estimated by 25-65%, in shared memory and registers alike: the compile step judges it.
"""
from __future__ import annotations

import dataclasses
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


_BWD_REG_OVERHEAD = 56  # measured: ptxas used ~40-75 registers more than the tiles below


def _wgmma(target, mma_m: int) -> bool:
    """Hopper's wgmma needs 64 rows per MMA (a warp group's); a smaller tile runs mma.sync."""
    return target.has("wgmma") and mma_m >= 64


def _bwd_dkdv(variant, problem, target) -> Resources:
    """attn_bwd_dkdv: K and V of BLOCK_N keys stay on chip, Q and dO of BLOCK_M rows (and their
    LSE and Delta) stream through num_stages buffers; S^T, P^T, dP^T are [BLOCK_N, BLOCK_M]."""
    e = dtype_bytes(problem.dtype)
    bd = block_d(problem.head_dim)
    m, n = variant.block_m, variant.block_n
    kv = 2 * n * bd * e
    rows = m * (2 * bd * e + 8)           # Q, dO and two float32 row vectors per stage
    stages = max(1, variant.num_stages)
    if _wgmma(target, n):                  # the MMAs read Q and dO from every buffer
        smem = kv + stages * rows
    else:                                  # one buffer is in registers; P^T goes through smem
        smem = kv + (stages - 1) * rows + m * n * e
    if variant.dq == "atomic":
        # dQ = dS K: with wgmma over fewer than 64 query rows K is copied once more as the
        # operand; past one stage the float32 dQ tile's layout change for the atomic add
        # takes scratch too (<= 64 rows of it: measured)
        if _wgmma(target, n) and m < 64:
            smem += n * bd * e
        if variant.loads == "descriptor":
            # the whole float32 tile staged for the TMA reduce-add, and dS^T for dQ's product
            # (sm_90, triton 3.9: within 0.5% of the compiler at m32-m128, n64-n128, D=128)
            smem += m * bd * 4 + m * n * e
        elif stages > 1:
            smem += min(m, 64) * bd * 4
    threads = 32 * variant.num_warps
    words = 2 * n * bd + 2 * n * m + n * m * e // 4   # dK, dV, S^T/dP^T (f32), dS^T
    if variant.dq == "atomic":
        words += m * bd                    # the dQ tile, float32, before its atomic add
    if not _wgmma(target, n):
        words += 2 * n * bd * e // 4       # K and V as mma.sync operands
    return Resources(smem, -(-words // threads) + _BWD_REG_OVERHEAD, threads)


def _bwd_dq(variant, problem, target) -> Resources:
    """attn_bwd_dq (dq="separate"): Q and dO of BLOCK_M2 rows stay, K and V of BLOCK_N2 keys
    stream through num_stages2 buffers; S, P, dP are [BLOCK_M2, BLOCK_N2]."""
    e = dtype_bytes(problem.dtype)
    bd = block_d(problem.head_dim)
    m, n = variant.block_m2, variant.block_n2
    qdo = 2 * m * bd * e
    kv = 2 * n * bd * e
    stages = max(1, variant.num_stages2)
    if _wgmma(target, m) or variant.dq_loads == "descriptor":  # a TMA ring holds every stage
        smem = qdo + stages * kv
    else:
        smem = qdo + (stages - 1) * kv + m * n * e
    threads = 32 * variant.num_warps2
    words = m * bd + 2 * m * n + m * n * e // 4       # dQ, S/dP (f32), dS
    if not _wgmma(target, m):
        words += 2 * m * bd * e // 4                  # Q and dO as mma.sync operands
    return Resources(smem, -(-words // threads) + _BWD_REG_OVERHEAD, threads)


def _bwd(variant, problem, target) -> tuple:
    dkdv = _bwd_dkdv(variant, problem, target)
    if variant.dq == "fused":
        # one kernel, its dQ programs on the kernel's warps and stages: it needs the larger of
        # the two halves (their buffers are live in turn, not at once: Triton reuses the space)
        dq = _bwd_dq(dataclasses.replace(variant, num_warps2=variant.num_warps,
                                         num_stages2=variant.num_stages), problem, target)
        dkdv = Resources(max(dkdv.smem_bytes, dq.smem_bytes),
                         max(dkdv.regs_per_thread, dq.regs_per_thread), dkdv.threads)
    out = (("attn_bwd_dkdv", dkdv),)
    if variant.dq == "separate":
        out += (("attn_bwd_dq", _bwd_dq(variant, problem, target)),)
    return out


def bwd_kernels(variant, problem, target) -> tuple:
    """(dK/dV kernel, dQ kernel or None) Resources of a bwd variant (the preprocess kernel is
    tiny: <= 512 B of shared memory, 64 registers)."""
    k = dict(_bwd(variant, problem, target))
    return k["attn_bwd_dkdv"], k.get("attn_bwd_dq")


def _splitkv_rows(variant, problem) -> int:
    """The partial kernel's BLOCK_M (launch_splitkv.row_block): GROUP x Nq rows, a power of two
    >= 16, at most the variant's block_m."""
    return min(variant.block_m, max(16, 1 << (problem.group * problem.seqlen_q - 1).bit_length()))


def _splitkv(variant, problem, target) -> Resources:
    """attn_splitkv_partial: a [BLOCK_M, BLOCK_D] Q tile and the [BLOCK_M, BLOCK_N] P tile in
    shared memory, K and V of BLOCK_N keys streamed through num_stages buffers of which one
    lives in registers (tiles of 16-64 rows run mma.sync), TMA adding half a stage and its
    barriers; at one stage half a K/V tile of layout scratch. Calibrated on 172 partial kernels
    compiled for sm_90 (bf16, D=64/128, BLOCK_N 16-256, 1-5 stages, both loads, GQA 8 x 1 and
    4 x 3 rows, Triton 3.9, 2026-11-23): within 0.1% of metadata.shared for every one.
    Registers: the S and P tiles, the output accumulator and the K/V operands of mma.sync
    (ptxas: 72-255 at 4 warps; the model is within -30%..+40%, up to +80% at BLOCK_N=256 with
    D=128, which the space excludes). The combine kernel is tiny (<= 2 KiB, 56 registers)."""
    e = dtype_bytes(problem.dtype)
    bd = block_d(problem.head_dim)
    if variant.gluon:
        return _splitkv_gluon(variant, bd, e)
    m, n = _splitkv_rows(variant, problem), variant.block_n
    kv = 2 * n * bd * e
    stages = max(1, variant.num_stages)
    extra = m * bd * e + m * n * e
    if stages == 1:
        smem = extra + kv // 2
    else:
        smem = (stages - 1) * kv + extra
        if variant.loads == "descriptor":
            smem += kv // 2 + 16 * stages
    threads = 32 * variant.num_warps
    words = m * n + m * n * e // 4 + m * bd + 2 * n * bd * e // 4
    return Resources(smem, -(-words // threads) + _REG_OVERHEAD, threads)


def _splitkv_gluon(variant, bd: int, e: int) -> Resources:
    """The gluon render's partial kernel: a ring of num_stages K and V tiles (TMA), the 64-row Q
    tile and one mbarrier per buffer in shared memory; S and O accumulate in one warpgroup's
    registers (wgmma), P stays there as the second MMA's A operand. sm_90 compiles (D=128 bf16,
    Triton 3.9, 2026-11-27): shared memory exact for n32-s4, n64-s2, n128-s2 and 8 B under for
    n128-s3 (213,048 B); registers 117-202 against the model's 120-192. block_m 16/32 (swap_ab):
    a block_m-row Q tile and P^T (block_n x block_m) in shared memory, S^T and O^T of block_m
    columns in registers."""
    n, stages, rows = variant.block_n, variant.num_stages, variant.block_m
    swap = variant.structure()["swap_ab"]
    p_smem = n * rows * e if swap else 0  # P^T through shared memory (wgmma's B)
    smem = 2 * stages * n * bd * e + rows * bd * e + p_smem + 16 * stages
    # S, P (in registers only where rows are M), O over the warpgroup's 128 threads
    words = rows * n + (0 if swap else rows * n * e // 4) + rows * bd
    return Resources(smem, -(-words // 128) + _REG_OVERHEAD, 128)


def splitkv_gluon_smem(variant, head_dim: int, elsize: int) -> int:
    """Shared memory of the gluon render's partial kernel (its launch's rules ask whether two
    fit on an SM)."""
    return _splitkv_gluon(variant, head_dim, elsize).smem_bytes


def splitkv_kernels(variant, problem, target) -> tuple:
    """(kernel, Resources) of the splitkv family: the partial kernel (the combine always fits)."""
    return (("attn_splitkv_partial", _splitkv(variant, problem, target)),)


def fwd_kernels(variant, problem, target) -> tuple:
    """(kernel, Resources) of the fwd family's one kernel."""
    return (("attn_fwd", _fwd(variant, problem, target)),)


bwd_kernels_all = _bwd  # the bwd family's model: dK/dV (with dQ's half for dq="fused"), and
#                        the dQ kernel for dq="separate"


def model_version(family: str) -> int:
    """Part of a space's hash (the family's feasibility_version): a new model of one family
    starts new studies of it only."""
    from .families import get
    return get(family).feasibility_version


def kernels(variant, problem, target) -> tuple:
    """(kernel name, Resources) of each kernel `variant` launches, each of which must fit on its
    own; () for a family without a model (pruned by its space's constraints alone)."""
    from .families import get
    return get(variant.family).resources(variant, problem, target)


def resources(variant, problem, target) -> Resources | None:
    """The main kernel's Resources (fwd: the only one; bwd: the dK/dV kernel)."""
    k = kernels(variant, problem, target)
    return k[0][1] if k else None


def check(variant, problem, target) -> Verdict:
    """Does `variant` fit `target` for `problem`? (structural features are the space's job)"""
    for name, r in kernels(variant, problem, target):
        if r.smem_bytes > target.smem_per_block:
            return Verdict(False, f"shared memory: {name} needs ~{r.smem_bytes} B, "
                                  f"{target.short} allows {target.smem_per_block} B per block")
        cap = min(target.max_regs_per_thread, target.regs_per_sm // r.threads)
        if r.regs_per_thread > cap * _SPILL_MARGIN:
            return Verdict(False, f"registers: {name} needs ~{r.regs_per_thread} per thread, "
                                  f"{target.short} allows {cap} at {r.threads} threads "
                                  "(certain to spill)")
    return OK
