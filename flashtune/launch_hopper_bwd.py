"""Launch the hopper_bwd family (Gluon, sm_90): Delta and LSE2 by the generic bwd family's
preprocess kernel, TMA descriptors over 3-D views of the tensors, one program per (key block,
batch * kv head), dQ accumulated in float32 and cast at the end (dq="separate": by the generic
bwd's dQ kernel, BwdPlan.run_dq); a sliding window, softcap and a
block mask's transposed lists as the variant's masked render takes them (launch.mask_args).
Which variant runs is decided by the caller; a call this kernel cannot address (head dim, dtype,
GPU, strides TMA cannot describe, misaligned bases) runs the generic bwd family's default
instead, masks included, as ops.run_backward expects of any plan."""
from __future__ import annotations

import dataclasses
import math

import torch
import triton

from . import alloc
from .codegen import Variant, load
from .launch_graphs import LaunchGraphs
from .launcher import Launcher, gluon_desc
from .launch import check_mask_variant, mask_args, mask_params
from .launch_hopper import (_device_blocker, _rows_view, _view3, addressable, kv_rows_copy,
                            packed_view3, tile_layouts)
from .launch_hopper import unsupported as _unsupported
from .families.hopper_bwd import dq_tiles
from .masks import NONE, Masks
from .relayout import like_copy, rows_copy

HEAD_DIMS = (64, 128, 256)  # D=256: two warpgroups split D for dK / dV (the template's SPLIT)
D256_TILE = (64, 64, 8)     # (block_m, block_n, num_warps): the one D=256 tile that fits


def dq_kernel_consts(variant: Variant, consts: dict) -> dict:
    """The constexprs of dq="gluon"'s dQ kernel from the dK/dV kernel's `consts`: the problem's
    (a window and softcap are run-time arguments; no block mask), its own tiles."""
    bm, bn, warps, stages = dq_tiles(variant)
    return dict(HEAD_DIM=consts["HEAD_DIM"], GROUP=consts["GROUP"], IS_CAUSAL=consts["IS_CAUSAL"],
                BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, num_warps=warps)


def unsupported(head_dim: int, dtype: torch.dtype) -> str:
    """Why the kernel cannot serve this head dim / dtype ("" when it can)."""
    return _unsupported(head_dim, dtype, HEAD_DIMS)


def _cannot_launch(variant: Variant, q: torch.Tensor) -> str:
    """Why `variant`'s kernels cannot run q's call ("" when they can): head dim, dtype, device,
    and at D=256 any tile but the one two warpgroups can hold."""
    d = q.shape[-1]
    why = unsupported(d, q.dtype) or _device_blocker(q.device)
    if not why and d > 128 and (variant.block_m, variant.block_n,
                                variant.num_warps) != D256_TILE:
        why = (f"{variant.name} cannot hold D={d}: only m64-n64-w8 does (two warpgroups split D "
               "for dK and dV)")
    return why


def _generic_variant(head_dim: int, dtype: torch.dtype, masks: Masks = NONE,
                     **fields) -> Variant:
    """The generic bwd family's default (what the dispatcher would pick without hopper_bwd and
    without tuned records; `fields` as default_variant's overrides, e.g. dq="separate") with
    `masks` rendered in, pointer loads (the bwd template has no others)."""
    from .defaults import default_variant
    from .dispatch import mask_twin, pointer_twin
    from .problem import dtype_name
    bv = default_variant("bwd", head_dim, dtype_name(dtype), **fields)
    if masks.any:
        bv = mask_twin(bv, masks, head_dim, dtype)
    return pointer_twin(bv) if bv.descriptors else bv


class HopperBwdPlan:
    """One hopper_bwd launch fixed by the call's shapes, strides, dtype, causal, scale and masks
    (window / softcap / block mask: the variant must render exactly those, its tiles fitted to the
    block mask, dispatch.mask_twin; built like launch.FwdPlan: Family.plan_for);
    run(dout, q, k, v, o, lse) -> (dq, dk, dv) in the dtype and layout of q, k, v, as
    launch_bwd.backward."""
    __slots__ = ("variant", "kernel", "grid", "scale", "causal", "consts", "layouts", "why",
                 "generic", "masks", "mask_args", "fallback", "pre", "dq_plan", "dq_kernel",
                 "dq_grid", "dq_mask_args", "rows", "graphs")
    descriptor = False

    def __init__(self, q, k, v, causal: bool, scale: float | None, variant: Variant,
                 masks: Masks = NONE):
        if variant.family != "hopper_bwd":
            raise ValueError(f"HopperBwdPlan needs a 'hopper_bwd' variant, got {variant.name}")
        if masks.block_mask is not None and variant.block_sparse:  # before the generic check:
            from .families.hopper_bwd import fit_block_mask  # it names the family's own rule
            tiles, why = fit_block_mask(variant, masks.block_mask)
            bad = {f: t for f, t in tiles.items() if getattr(variant, f) != t}
            if why or bad:  # a program or step across two blocks would walk the wrong lists
                raise ValueError(f"{variant.name}: " + (why or (
                    f"its tiles must fit the block mask's block_size {masks.block_mask.block_size}"
                    f" (as {bad}; dispatch.mask_twin fits them)")))
        check_mask_variant(variant, masks)
        if variant.dq == "gluon" and masks.block_mask is not None:
            raise ValueError(f"{variant.name}: dq='gluon''s dQ kernel walks no block mask: use "
                             "dq='none' or 'separate'")
        b, h, nq, d = q.shape
        self.variant = variant
        self.causal = bool(causal)
        self.masks = masks
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.generic = _generic_variant(d, q.dtype)  # its preprocess (no masks in 16 bits)
        self.fallback = None  # the generic bwd's plan, built when first needed
        self.dq_plan = None  # dq="separate": the generic bwd's plan that runs dQ
        self.dq_kernel = None  # dq="gluon": the template's dQ kernel, one program a query block
        self.rows = None  # (B, N, H, D) memory: the varlen render on equal lengths (RowsBwd)
        self.graphs = LaunchGraphs()  # a repeated call's launches as one CUDA graph
        self.why = _cannot_launch(variant, q)
        if not self.why and not all(_view3(t) for t in (q, k, v)):
            copy_kv = kv_rows_copy(q, q, k, v)  # O and dO come in q's layout (else copied)
            if not copy_kv and not all(_rows_view(t) for t in (q, k, v)):
                self.why = "strides TMA cannot describe as (B*H, N, D) nor as (B*N, H, D)"
            elif masks.any or variant.dq_overlap:
                self.why = ("(B, N, H, D) memory: the varlen render it runs takes no window, "
                            "softcap, block mask or dq_overlap")
            else:
                self.rows = RowsBwd(q, k, self.causal, scale, variant, copy_kv)
                self.why = self.rows.plan.why
            return
        if not self.why and b * h > 65535:  # its grids' second axis: B * Hk, dQ's B * H
            self.why = f"batch x heads = {b * h} passes a grid axis's 65,535"
        if self.why:
            return
        # the window's bounds (causal: its right edge 0) and the softcap, after sm_scale
        self.mask_args = mask_args(masks, causal, "kv", b, h)
        self.layouts = tile_layouts(q.dtype, d, variant.block_m, variant.block_n,
                                    *dq_tiles(variant)[:2])
        hk, nk = k.shape[1], k.shape[2]
        self.grid = (triton.cdiv(nk, variant.block_n), b * hk)
        self.consts = dict(HEAD_DIM=d, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                           STAGES=variant.num_stages, GROUP=h // hk, IS_CAUSAL=self.causal,
                           num_warps=variant.num_warps, **mask_params(masks))
        self.kernel = Launcher(load(variant).attn_bwd_hopper, **self.consts)
        self.pre = preprocess_launch(q, k, self.causal, self.generic)
        if variant.dq == "gluon":
            dq_consts = dq_kernel_consts(variant, self.consts)
            self.dq_kernel = Launcher(load(variant).attn_bwd_dq_hopper, **dq_consts)
            self.dq_grid = (triton.cdiv(nq, dq_consts["BLOCK_M"]), b * h)
            # window / softcap: the same bounds and cap as the dK/dV kernel's (no block mask)
            self.dq_mask_args = mask_args(masks, causal, "q", b, h)
        # dq="separate": the generic bwd's dQ kernel (its default tiles, the call's masks)
        if variant.dq == "separate":
            from . import launch_bwd
            self.dq_plan = launch_bwd.plan(q, k, self.causal, self.scale,
                                           _generic_variant(d, q.dtype, masks, dq="separate"),
                                           masks)

    def run(self, dout, q, k, v, o, lse):
        if self.rows is not None:
            return self.rows.run(dout, q, k, v, o, lse)
        dk = alloc.empty_like(k)  # keeps the caller's layout, as the generic bwd
        dv = alloc.empty_like(v)
        if not self.why and not addressable(dout) and addressable(q, k, v, dk, dv):
            dout = dout.contiguous()  # e.g. the (B, N, H, D) gradient of a (B, H, N, D) output
        if self.why or not addressable(q, k, v, dout, dk, dv):  # base addresses: per call
            if self.fallback is None:
                from . import launch_bwd
                self.fallback = launch_bwd.plan(
                    q, k, self.causal, self.scale,
                    _generic_variant(q.shape[3], q.dtype, self.masks), self.masks)
            return self.fallback.run(dout, q, k, v, o, lse)
        separate = self.dq_plan is not None or self.dq_kernel is not None
        # every buffer before any launch: the launches depend on the call only through these
        # addresses, which makes them a graph's key (launch_graphs)
        delta, lse2 = preprocess_buffers(q)
        # the kernel adds dQ into a float32 buffer (dq="none"); separate, gluon: it writes none
        dq_acc = delta if separate else torch.empty(q.shape, dtype=torch.float32,
                                                     device=q.device)
        dq = alloc.empty_like(q)  # q's layout, as the generic bwd (dq_acc is contiguous)
        # TMA stores dQ in q's layout; one it cannot address goes through a contiguous copy
        out = dq if self.dq_kernel is None or addressable(dq) else torch.empty(
            q.shape, dtype=q.dtype, device=q.device)

        def launches():
            self._launch(dout, q, k, v, o, lse, dk, dv, dq, out, delta, lse2, dq_acc)
        if self.dq_plan is not None or not q.is_cuda:  # the generic dQ kernel's plan
            launches()  # allocates; meta tensors: the search's compile-ahead
        else:
            self.graphs.run((dout.data_ptr(), *dout.stride(), o.data_ptr(), *o.stride(),
                             q.data_ptr(), k.data_ptr(), v.data_ptr(), lse.data_ptr(),
                             dk.data_ptr(), dv.data_ptr(), dq.data_ptr(), out.data_ptr(),
                             delta.data_ptr(), lse2.data_ptr(), dq_acc.data_ptr()), launches,
                            q.get_device())
        return dq, dk, dv

    def _launch(self, dout, q, k, v, o, lse, dk, dv, dq, out, delta, lse2, dq_acc):
        """The call's kernels into its buffers (allocated by run: nothing allocates here)."""
        preprocess(self.pre, dout, q, k, v, o, lse, self.scale, delta, lse2)
        if dq_acc is not delta:
            dq_acc.zero_()
        bm, bn, d = self.variant.block_m, self.variant.block_n, q.shape[3]
        made: dict = {}

        def desc(t, rows):
            # one descriptor per (tensor, rows) a call: the dQ kernel's q, k, v and dO views are
            # the dK/dV kernel's where their tiles are (host time: session 31, bench/host_bwd.py)
            key = (id(t), rows)
            got = made.get(key)
            if got is None:
                shape, strides = _view3(t)
                got = made[key] = gluon_desc(t, shape, strides, [1, rows, d],
                                             self.layouts[rows])
            return got
        self.kernel(self.grid, desc(q, bm), desc(k, bn), desc(v, bn), desc(dout, bm),
                    desc(dk, bn), desc(dv, bn), dq_acc, lse2, delta, self.scale,
                    *self.mask_args, q.shape[1], q.shape[2], k.shape[2])
        if self.dq_kernel is not None:
            bm2, bn2 = dq_tiles(self.variant)[:2]
            self.dq_kernel(self.dq_grid, desc(q, bm2), desc(k, bn2), desc(v, bn2),
                           desc(dout, bm2), desc(out, bm2), lse2, delta, self.scale,
                           *self.dq_mask_args, q.shape[1], q.shape[2], k.shape[2])
            if out is not dq:
                dq.copy_(out)
        elif self.dq_plan is not None:
            self.dq_plan.run_dq(dout, q, k, v, dq, lse2, delta)
        else:
            dq.copy_(dq_acc)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """The (B*N, H, D) view of a (B, H, N, D) tensor in (B, N, H, D) memory (a copy otherwise)."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h, d)


class RowsBwd:
    """A dense backward whose q, k, v lie in (B, N, H, D) memory (a transformers model's
    projections), run by hopper_bwd's varlen render as B sequences of equal lengths over the
    (B*N, H, D) views -- no copy of q, k, v; dO and O are copied only in another layout. Its
    tiles take their rows by (head, sequence start + row): the dense render's (B*H, N, D)
    descriptors cannot describe that memory, and the varlen kernels ran within 3% of the dense
    render's on the same problem (docs/benchmarks.md, session 27). LSE goes in as (H, B*Nq), a
    copy of B*H*Nq floats. copy_kv (launch_hopper.kv_rows_copy: K and V in another layout than
    q, as a transformers model hands them): K and V are copied into q's layout each call, and
    dK, dV copied back into theirs."""
    __slots__ = ("plan", "cu", "copy_kv")

    def __init__(self, q, k, causal: bool, scale: float | None, variant: Variant,
                 copy_kv: bool = False):
        b, hk, nq, d = q.shape[0], k.shape[1], q.shape[2], q.shape[3]
        nk = k.shape[2]
        self.copy_kv = copy_kv
        if copy_kv:  # the plan sees K as its copy will be (nothing is copied here)
            k = torch.empty((b, nk, hk, d), dtype=k.dtype, device="meta").transpose(1, 2)
        self.plan = HopperBwdVarlenPlan(_packed(q), _packed(k), b, nq, nk, causal, scale,
                                        dataclasses.replace(variant, varlen=True))
        self.cu = tuple(torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
                        for n in (nq, nk))

    def run(self, dout, q, k, v, o, lse):
        b, h, nq, _ = q.shape
        kc, vc = (rows_copy(k), rows_copy(v)) if self.copy_kv else (k, v)
        grads = self.plan.run(*map(_packed, (dout, q, kc, vc, o)),
                              lse.transpose(0, 1).reshape(h, b * nq), self.cu)
        # (B*N, H, D) in the layout of the packed views: back to (B, H, N, D) views of it
        dq, dk, dv = (g.view(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)
                      for g, x in zip(grads, (q, kc, vc)))
        if self.copy_kv:  # the gradients in K's and V's own layout
            dk, dv = like_copy(k, dk), like_copy(v, dv)
        return dq, dk, dv


def preprocess_launch(q, k, causal: bool, generic: Variant) -> tuple:
    """(launcher, grid) of the generic bwd family's attn_bwd_preprocess for this call (16-bit
    inputs, no masks), as launch_bwd launches it."""
    from .launch_bwd import kernel_params
    b, h, nq, d = q.shape
    consts, warps, stages = kernel_params(generic, q.dtype, d, causal, h // k.shape[1], nq,
                                          k.shape[2])["pre"]
    return (Launcher(load(generic).attn_bwd_preprocess, **consts, num_warps=warps,
                     num_stages=stages), (triton.cdiv(nq, consts["PRE_M"]) * b * h,))


def preprocess_buffers(q) -> tuple:
    """(Delta, LSE2): float32 (B, H, Nq), contiguous, for preprocess to fill."""
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return delta, alloc.empty_like(delta)


def preprocess(pre: tuple, dout, q, k, v, o, lse, scale: float, delta, lse2) -> None:
    """Delta = rowsum(dO * O) and LSE2 = LSE * log2(e) (+inf where LSE = -inf) into the
    buffers of preprocess_buffers, by the launch preprocess_launch describes."""
    from .launch import strides3
    kernel, grid = pre
    kernel(grid, o, dout, lse, delta, lse2, delta, q, k, v, scale, *strides3(o, dout, q, k, v),
           q.shape[1], q.shape[2], k.shape[2])


def backward(dout, q, k, v, o, lse, causal: bool, scale: float | None, variant: Variant,
             masks: Masks = NONE):
    """Run a hopper_bwd variant: (dq, dk, dv) in the dtype and layout of q, k, v; masks: the
    call's window / softcap (validated, flashtune/masks.py), rendered in `variant`."""
    return HopperBwdPlan(q, k, v, causal, scale, variant, masks).run(dout, q, k, v, o, lse)


def _grid(blocks: int, rows: int) -> tuple:
    """(blocks, sequences * heads) as the varlen render reads it: the second over grid axes 1
    and 2 (program_id(1) + program_id(2) * 65535), each at most 65,535."""
    return (blocks, min(rows, 65535), triton.cdiv(rows, 65535))


class HopperBwdVarlenPlan:
    """A hopper_bwd varlen render's launch for packed sequences (q (total_q, H, D), k (total_k,
    Hk, D)): the generic bwd family's varlen preprocess (Delta, LSE2 as (H, total_q)), then one
    program per (key block of the longest sequence, sequence * kv head) over (H, total, D)
    descriptor views, each placing its tiles at its sequence's first row (programs past a
    sequence's end return at once); dQ as the variant says (dq="gluon": the varlen dQ kernel;
    "separate": the generic bwd's varlen dQ kernel; "none": float32 atomics into an (H, total_q,
    D) buffer). No masks beyond causal (the dispatcher gives masked varlen calls the generic
    bwd). A call the kernels cannot address runs the generic bwd's varlen default."""
    __slots__ = ("variant", "kernel", "grid", "scale", "causal", "layouts", "why", "generic",
                 "fallback", "dq_kernel", "dq_grid", "sizes", "seq")
    descriptor = False

    def __init__(self, q, k, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                 scale: float | None, variant: Variant):
        from . import launch_bwd
        from .dispatch import varlen_twin
        if variant.family != "hopper_bwd" or not variant.varlen:
            raise ValueError(f"HopperBwdVarlenPlan needs a varlen 'hopper_bwd' variant, got "
                             f"{variant.name}")
        total_q, h, d = q.shape
        total_k, hk, _ = k.shape
        self.variant, self.causal = variant, bool(causal)
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.seq = (batch, max_seqlen_q, max_seqlen_k)
        self.fallback = None  # the generic bwd's varlen plan, built when first needed
        self.why = _cannot_launch(variant, q)
        if self.why:
            return
        # its preprocess (and, dq="separate", its dQ kernel): the generic varlen plan
        fields = {"dq": "separate"} if variant.dq == "separate" else {}
        self.generic = launch_bwd.varlen_plan(
            q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale,
            varlen_twin(_generic_variant(d, q.dtype, **fields)))
        self.layouts = tile_layouts(q.dtype, d, variant.block_m, variant.block_n,
                                    *dq_tiles(variant)[:2])
        self.grid = _grid(triton.cdiv(max_seqlen_k, variant.block_n), batch * hk)
        self.sizes = (h, max_seqlen_q, max_seqlen_k, total_q, total_k, batch)
        consts = dict(HEAD_DIM=d, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                      STAGES=variant.num_stages, GROUP=h // hk, IS_CAUSAL=self.causal,
                      num_warps=variant.num_warps)
        self.kernel = Launcher(load(variant).attn_bwd_hopper, **consts)
        self.dq_kernel = None
        if variant.dq == "gluon":
            dq_consts = dq_kernel_consts(variant, consts)
            self.dq_kernel = Launcher(load(variant).attn_bwd_dq_hopper, **dq_consts)
            self.dq_grid = _grid(triton.cdiv(max_seqlen_q, dq_consts["BLOCK_M"]), batch * h)

    def run(self, dout, q, k, v, o, lse, seq_args: tuple):
        if self.why or not addressable(q, k, v, dout, view=packed_view3):
            if self.fallback is None:
                from . import launch_bwd
                from .dispatch import varlen_twin
                self.fallback = launch_bwd.varlen_plan(
                    q, k, *self.seq, self.causal, self.scale,
                    varlen_twin(_generic_variant(q.shape[2], q.dtype)))
            return self.fallback.run(dout, q, k, v, o, lse, seq_args)
        cu_q, cu_k = seq_args
        # like the inputs (alloc keeps a dense layout; 16-byte strides and bases as theirs)
        dk, dv, dq = alloc.empty_like(k), alloc.empty_like(v), alloc.empty_like(q)
        delta, lse2, _ = self.generic.run_pre(dout, q, k, v, o, lse, seq_args)
        h, total_q, d = q.shape[1], q.shape[0], q.shape[2]
        atomic = self.variant.dq == "none"
        # dq="none": the kernel adds dQ into a float32 (H, total_q, D) buffer; else it writes none
        dq_acc = (torch.zeros((h, total_q, d), dtype=torch.float32, device=q.device) if atomic
                  else delta)
        bm, bn = self.variant.block_m, self.variant.block_n

        def desc(t, rows):
            shape, strides = packed_view3(t)
            return gluon_desc(t, shape, strides, [1, rows, d], self.layouts[rows])
        self.kernel(self.grid, desc(q, bm), desc(k, bn), desc(v, bn), desc(dout, bm),
                    desc(dk, bn), desc(dv, bn), dq_acc, lse2, delta, self.scale, dk, dv, cu_q,
                    cu_k, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *self.sizes)
        if self.dq_kernel is not None:
            bm2, bn2 = dq_tiles(self.variant)[:2]
            self.dq_kernel(self.dq_grid, desc(q, bm2), desc(k, bn2), desc(v, bn2),
                           desc(dout, bm2), desc(dq, bm2), lse2, delta, self.scale, dq, cu_q,
                           cu_k, dq.stride(0), dq.stride(1), *self.sizes)
        elif atomic:
            dq.copy_(dq_acc.transpose(0, 1))
        else:
            self.generic.run_dq(dout, q, k, v, dq, lse2, delta, None, seq_args)
        return dq, dk, dv


def varlen_plan(q, k, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                scale: float | None, variant: Variant, masks: Masks = NONE) -> HopperBwdVarlenPlan:
    """The hopper_bwd varlen plan of a packed call (Family.varlen_plan); no masks beyond causal."""
    if masks.any:
        raise ValueError(f"{variant.name}: the hopper_bwd varlen render takes no window, softcap "
                         "or block mask (the dispatcher runs masked varlen calls on the generic "
                         "bwd)")
    return HopperBwdVarlenPlan(q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale, variant)
