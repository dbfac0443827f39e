"""Launch the generated backward kernels for one problem: buffers, grids, strides, constexprs."""
from __future__ import annotations

import math

import torch
import triton

from .codegen import Variant, load
from .launch import _DOT_PRECISION, block_d, strides3


def _pre_m(bd: int, precise: bool = False) -> int:
    # rows per preprocess program: a [PRE_M, BLOCK_D] tile of O and dO, ~8k elements each;
    # PRECISE (float32) loops over the keys with float64 tiles: keep those small
    return max(16, min(32 if precise else 128, 8192 // bd))


def kernel_params(variant: Variant, dtype: torch.dtype, head_dim: int, causal: bool, group: int,
                  nq: int, nk: int) -> dict:
    """{kernel: (constexprs, num_warps, num_stages)} of each kernel the bwd variant launches:
    the one place that knows them (backward() and compile_check both use it)."""
    bd = block_d(head_dim)
    precise = dtype == torch.float32
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, IS_CAUSAL=causal, GROUP=group, PRECISE=precise)
    tiles = dict(common, PAD_D=bd != head_dim, DOT_PRECISION=_DOT_PRECISION.get(dtype, "tf32"))
    bm, bn = variant.block_m, variant.block_n
    out = {"pre": (dict(common, PRE_M=_pre_m(bd, precise), PRE_N=32), 4, 3),
           "dkdv": (dict(tiles, BLOCK_M=bm, BLOCK_N=bn, EVEN_M=nq % bm == 0, EVEN_N=nk % bn == 0,
                         MASK_KEYS=variant.dq == "atomic" and nk % bn != 0),
                    variant.num_warps, variant.num_stages)}
    if variant.dq == "separate":
        bm2, bn2 = variant.block_m2, variant.block_n2
        out["dq"] = (dict(tiles, BLOCK_M=bm2, BLOCK_N=bn2, EVEN_M=nq % bm2 == 0,
                          EVEN_N=nk % bn2 == 0), variant.num_warps2, variant.num_stages2)
    return out


def backward(dout, q, k, v, o, lse, causal: bool, scale: float | None, variant: Variant):
    """Run the bwd variant: returns (dq, dk, dv) in the dtype and layout of q, k, v.

    dout, q, o: (B, H, Nq, D); k, v: (B, Hk, Nk, D); lse: float32 (B, H, Nq), natural log.
    Every tensor has a contiguous last dim; the caller handles the empty cases.
    """
    if variant.family != "bwd":
        raise ValueError(f"backward needs a 'bwd' variant, got {variant.name}")
    if variant.loads != "pointer":
        raise ValueError(f"bwd variant {variant.name}: the bwd template has only pointer loads")
    if variant.dq == "separate" and not (variant.block_m2 and variant.block_n2
                                         and variant.num_warps2 and variant.num_stages2):
        raise ValueError(f"bwd variant {variant.name}: dq='separate' needs block_m2, block_n2, "
                         "num_warps2 and num_stages2 (the dQ kernel's tiles)")
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mod = load(variant)
    params = kernel_params(variant, q.dtype, d, causal, h // hk, nq, nk)

    # Delta = rowsum(dO * O) and LSE in base 2 (+inf for rows that see no key): float32, tiny.
    # float32 inputs (PRECISE): Delta and R = 1 / rowsum(P) from one pass over the keys instead
    # (see the template's header)
    precise = q.dtype == torch.float32
    delta = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    r = torch.empty_like(delta) if precise else delta  # unused unless precise
    consts, warps, stages = params["pre"]
    mod.attn_bwd_preprocess[(triton.cdiv(nq, consts["PRE_M"]) * b * h,)](
        o, dout, lse, delta, lse2, r, q, k, v, scale,
        *strides3(o, dout, q, k, v),
        h, nq, nk, **consts, num_warps=warps, num_stages=stages,
    )

    dk = torch.empty_like(k)  # keeps the caller's layout when dense
    dv = torch.empty_like(v)
    if variant.dq == "atomic":
        # float32 accumulation: into dq itself for float32 inputs, else a buffer cast at the end
        if q.dtype == torch.float32:
            dq = dq_acc = torch.zeros_like(q)
        else:
            dq = torch.empty_like(q)
            dq_acc = torch.zeros((b, h, nq, d), dtype=torch.float32, device=q.device)
    else:
        dq = dq_acc = torch.empty_like(q)

    consts, warps, stages = params["dkdv"]
    mod.attn_bwd_dkdv[(triton.cdiv(nk, variant.block_n) * b * hk,)](
        q, k, v, dout, dk, dv, dq_acc, lse2, delta, r, scale,
        *strides3(q, k, v, dout, dk, dv, dq_acc),
        h, nq, nk, **consts, num_warps=warps, num_stages=stages,
    )

    if variant.dq == "separate":
        consts, warps, stages = params["dq"]
        mod.attn_bwd_dq[(triton.cdiv(nq, variant.block_m2) * b * h,)](
            q, k, v, dout, dq, lse2, delta, r, scale,
            *strides3(q, k, v, dout, dq),
            h, nq, nk, **consts, num_warps=warps, num_stages=stages,
        )
    elif dq_acc is not dq:
        dq.copy_(dq_acc)
    return dq, dk, dv
