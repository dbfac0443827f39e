"""Launch the generated backward kernels for one problem: buffers, grids, strides, constexprs."""
from __future__ import annotations

import functools
import math

import torch
import triton

from . import alloc
from .codegen import Variant, load
from .launcher import Launcher
from .launch import (_DOT_PRECISION, _need_allocator, block_d, block_lists, check_mask_variant,
                     check_varlen_variant, descriptor_ok, mask_args, mask_params, packed_view,
                     strides3)
from .masks import NONE, Masks


def _pre_m(bd: int, precise: bool = False) -> int:
    # rows per preprocess program: a [PRE_M, BLOCK_D] tile of O and dO, ~8k elements each;
    # PRECISE (float32) loops over the keys with float64 tiles: keep those small
    return max(16, min(32 if precise else 128, 8192 // bd))


def kernel_params(variant: Variant, dtype: torch.dtype, head_dim: int, causal: bool, group: int,
                  nq: int | None, nk: int | None, *, varlen: bool = False,
                  masks: Masks = NONE) -> dict:
    """{kernel: (constexprs, num_warps, num_stages)} of each kernel the bwd variant launches:
    the one place that knows them (plan(), varlen_plan() and compile_check use it).
    varlen: sequence lengths vary per program, so no tile is known to be even (nq, nk unused).
    masks: a block mask's block size and element mask (its loops step through whole blocks,
    so a tile is even only when the block size divides the length)."""
    bd = block_d(head_dim)
    precise = dtype == torch.float32
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, IS_CAUSAL=causal, GROUP=group, PRECISE=precise,
                  **mask_params(masks))
    tiles = dict(common, PAD_D=bd != head_dim, DOT_PRECISION=_DOT_PRECISION.get(dtype, "tf32"))
    blk = masks.block_mask

    def even(n, block, axis):
        if blk is not None:
            block = max(block, blk.block_size[axis])
        return not varlen and n % block == 0

    bm, bn = variant.block_m, variant.block_n
    bm2, bn2 = variant.block_m2, variant.block_n2
    dkdv = dict(tiles, BLOCK_M=bm, BLOCK_N=bn, EVEN_M=even(nq, bm, 0), EVEN_N=even(nk, bn, 1),
                MASK_KEYS=variant.dq == "atomic" and not even(nk, bn, 1))
    if variant.dq == "fused":  # one kernel: the dQ programs' tiles ride along
        dkdv.update(BLOCK_M2=bm2, BLOCK_N2=bn2, EVEN_M2=even(nq, bm2, 0), EVEN_N2=even(nk, bn2, 1))
    out = {"pre": (dict(common, PRE_M=_pre_m(bd, precise), PRE_N=32), 4, 3),
           "dkdv": (dkdv, variant.num_warps, variant.num_stages)}
    if variant.dq == "separate":
        out["dq"] = (dict(tiles, BLOCK_M=bm2, BLOCK_N=bn2, EVEN_M=even(nq, bm2, 0),
                          EVEN_N=even(nk, bn2, 1)), variant.num_warps2, variant.num_stages2)
    return out


def _check_variant(variant: Variant) -> None:
    if variant.family != "bwd":
        raise ValueError(f"backward needs a 'bwd' variant, got {variant.name}")
    if variant.dq == "separate" and not (variant.block_m2 and variant.block_n2
                                         and variant.num_warps2 and variant.num_stages2):
        raise ValueError(f"bwd variant {variant.name}: dq='separate' needs block_m2, block_n2, "
                         "num_warps2 and num_stages2 (the dQ kernel's tiles)")
    if variant.dq == "fused" and not (variant.block_m2 and variant.block_n2
                                      and not variant.num_warps2 and not variant.num_stages2):
        raise ValueError(f"bwd variant {variant.name}: dq='fused' needs block_m2 and block_n2 (the "
                         "dQ programs' tiles) and no num_warps2/num_stages2 (one kernel, one "
                         "launch: num_warps and num_stages serve both)")


class BwdPlan:
    """Everything about one bwd launch that depends only on the call's shapes, dtype, causal,
    scale and masks (its constexprs, grids, the masks' runtime arguments, the kernels) -- built
    once per such call signature (ops.run_backward memoizes it), so a repeated backward pays for
    its buffers and the launches. run() takes the tensors' strides per call.

    views turns a tensor into the (B, H, N, D) view whose strides the kernels take, `rows` is the
    shape of the per-row float32 buffers (LSE's), `sizes` the kernels' trailing ints; the grids
    cover batch x heads x cdiv(max_q or max_k, block)."""
    __slots__ = ("variant", "params", "scale", "margs", "views", "rows", "sizes", "grids",
                 "kernels", "precise", "atomic", "descriptor", "twin")

    def __init__(self, variant: Variant, params: dict, head_dim: int, dtype: torch.dtype,
                 causal: bool, scale: float | None, *, views, rows: tuple, sizes: tuple,
                 batch: int, heads: int, kv_heads: int, max_q: int, max_k: int,
                 masks: Masks = NONE):
        # the variant and masks are checked by plan() / varlen_plan(), before kernel_params
        self.variant, self.params, self.views, self.rows, self.sizes = (variant, params, views,
                                                                        rows, sizes)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.precise = dtype == torch.float32
        self.atomic = variant.dq == "atomic"
        # the inputs read through descriptors (run()'s dout, q, k, v by index: loads Q and dO,
        # and the float32 dQ buffer; dq_loads K and V) must suit TMA, checked per call; a call
        # whose tensors do not runs the pointer twin's plan, built when first needed
        self.descriptor = ((0, 1) if variant.loads == "descriptor" else ()) + \
            ((2, 3) if variant.dq_loads == "descriptor" else ())
        self.twin = None
        if self.descriptor:
            from .dispatch import pointer_twin
            self.twin = functools.partial(
                BwdPlan, pointer_twin(variant), params, head_dim, dtype, causal, scale,
                views=views, rows=rows, sizes=sizes, batch=batch, heads=heads,
                kv_heads=kv_heads, max_q=max_q, max_k=max_k, masks=masks)
        # the masks' runtime arguments, after sm_scale (launch.mask_args), per kernel
        self.margs = ({kern: mask_args(masks, causal, kern, batch, heads)
                       for kern in ("q", "kv", "state")} if masks.any else
                      {"q": (), "kv": (), "state": ()})
        programs = triton.cdiv(max_k, variant.block_n)  # per (batch, kv head)
        if variant.dq == "fused":  # and the dQ programs of its q heads (the template's layout)
            programs += (heads // kv_heads) * triton.cdiv(max_q, variant.block_m2)
            if masks.block_mask is not None:  # and their key lists
                self.margs["kv"] = (*self.margs["kv"], *block_lists(masks.block_mask, "q"))
        mod = load(variant)

        def launcher(kernel, part):
            consts, warps, stages = params[part]
            return Launcher(kernel, **consts, num_warps=warps, num_stages=stages)
        self.kernels = (launcher(mod.attn_bwd_preprocess, "pre"),
                        launcher(mod.attn_bwd_dkdv, "dkdv"),
                        launcher(mod.attn_bwd_dq, "dq") if variant.dq == "separate" else None)
        self.grids = ((triton.cdiv(max_q, params["pre"][0]["PRE_M"]) * batch * heads,),
                      (programs * batch * kv_heads,),
                      (triton.cdiv(max_q, variant.block_m2 or 1) * batch * heads,))

    def run(self, dout, q, k, v, o, lse, seq_args: tuple = ()):
        """(dq, dk, dv) like q, k, v; seq_args: the cu_seqlens pointers (varlen renders)."""
        views, sizes, scale, margs = self.views, self.sizes, self.scale, self.margs
        if self.descriptor:
            ins = (dout, q, k, v)
            if not descriptor_ok(*(views(ins[i]) for i in self.descriptor)):
                if not isinstance(self.twin, BwdPlan):
                    self.twin = self.twin()
                return self.twin.run(dout, q, k, v, o, lse, seq_args)
            _need_allocator()
        _, dkdv, dqk = self.kernels
        delta, lse2, r = self.run_pre(dout, q, k, v, o, lse, seq_args)

        dk = alloc.empty_like(k)  # keeps the caller's layout when dense
        dv = alloc.empty_like(v)
        if self.atomic:
            # float32 accumulation: into dq itself for float32 inputs, else a buffer cast at
            # the end
            if self.precise:
                dq = dq_acc = alloc.zeros_like(q)
            else:
                dq = alloc.empty_like(q)
                dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        else:
            dq = dq_acc = alloc.empty_like(q)

        dkdv(self.grids[1],
             q, k, v, dout, dk, dv, dq_acc, lse2, delta, r, *seq_args, scale, *margs["kv"],
             *strides3(*map(views, (q, k, v, dout, dk, dv, dq_acc))), *sizes)

        if dqk is not None:
            self.run_dq(dout, q, k, v, dq, lse2, delta, r, seq_args)
        elif dq_acc is not dq:
            dq.copy_(dq_acc)
        return dq, dk, dv

    def run_pre(self, dout, q, k, v, o, lse, seq_args: tuple = ()) -> tuple:
        """(Delta, LSE2, R): the preprocess launch alone, run()'s first (hopper_bwd's varlen plan
        runs it too). Delta = rowsum(dO * O) and LSE in base 2 (+inf for rows that see no key):
        float32 of shape self.rows, tiny. float32 inputs (PRECISE): Delta and R = 1 / rowsum(P)
        from one pass over the keys instead (see the template's header); R is Delta otherwise."""
        delta = torch.empty(self.rows, dtype=torch.float32, device=q.device)
        lse2 = alloc.empty_like(delta)
        r = alloc.empty_like(delta) if self.precise else delta  # unused unless precise
        self.kernels[0](self.grids[0],
                        o, dout, lse, delta, lse2, r, q, k, v, *seq_args, self.scale,
                        *self.margs["state"], *strides3(*map(self.views, (o, dout, q, k, v))),
                        *self.sizes)
        return delta, lse2, r

    def run_dq(self, dout, q, k, v, dq, lse2, delta, r=None, seq_args: tuple = ()) -> None:
        """The dQ kernel alone (dq="separate") into dq, from the preprocess's LSE2 and Delta
        (r: 1 / rowsum(P), float32 inputs only): run()'s last launch, and hopper_bwd's dQ
        where its kernel computes dK and dV only."""
        self.kernels[2](self.grids[2],
                        q, k, v, dout, dq, lse2, delta, delta if r is None else r, *seq_args,
                        self.scale, *self.margs["q"],
                        *strides3(*map(self.views, (q, k, v, dout, dq))), *self.sizes)


def _same(t):
    return t


def plan(q, k, causal: bool, scale: float | None, variant: Variant,
         masks: Masks = NONE) -> BwdPlan:
    """The BwdPlan of a dense call with q (B, H, Nq, D), k (B, Hk, Nk, D)."""
    _check_variant(variant)  # before its tiles are used
    check_mask_variant(variant, masks)
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    params = kernel_params(variant, q.dtype, d, causal, h // hk, nq, nk, masks=masks)
    return BwdPlan(variant, params, d, q.dtype, causal, scale, views=_same, rows=(b, h, nq),
                   sizes=(h, nq, nk), batch=b, heads=h, kv_heads=hk, max_q=nq, max_k=nk,
                   masks=masks)


def backward(dout, q, k, v, o, lse, causal: bool, scale: float | None, variant: Variant,
             masks: Masks = NONE):
    """Run the bwd variant: returns (dq, dk, dv) in the dtype and layout of q, k, v.

    dout, q, o: (B, H, Nq, D); k, v: (B, Hk, Nk, D); lse: float32 (B, H, Nq), natural log.
    Every tensor has a contiguous last dim; the caller handles the empty cases.
    """
    return plan(q, k, causal, scale, variant, masks).run(dout, q, k, v, o, lse)


def varlen_plan(q, k, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                scale: float | None, variant: Variant, masks: Masks = NONE) -> BwdPlan:
    """The BwdPlan of a varlen call on packed q (total_q, H, D), k (total_k, Hk, D)."""
    _check_variant(variant)
    check_varlen_variant(variant)
    check_mask_variant(variant, masks)
    if masks.block_mask is not None:
        raise ValueError("block_mask is not supported with packed variable-length sequences")
    total_q, h, d = q.shape
    hk = k.shape[1]
    params = kernel_params(variant, q.dtype, d, causal, h // hk, None, None, varlen=True)
    return BwdPlan(variant, params, d, q.dtype, causal, scale, views=packed_view,
                   rows=(h, total_q), sizes=(h, max_seqlen_q, max_seqlen_k, total_q, k.shape[0]),
                   batch=batch, heads=h, kv_heads=hk, max_q=max_seqlen_q, max_k=max_seqlen_k,
                   masks=masks)
