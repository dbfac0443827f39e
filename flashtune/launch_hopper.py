"""Launch the hopper_fwd family (Gluon, sm_90): TMA descriptors over 3-D views of the tensors
((B*H, N, D), or (B, N, H*D) through the variant's bnhd render: tile_view),
the grid (one program per tile, or one per SM when persistent), the register split. Which
variant runs is decided by the caller; a call this kernel cannot address (strides TMA cannot
describe, misaligned bases) runs the generic fwd family's default instead, as ops.run_forward
expects of any plan."""
from __future__ import annotations

import dataclasses
import math

import torch
import triton

from . import alloc
from .codegen import Variant, load
from .families.hopper_fwd import consumers
from .launcher import Launcher, gluon_desc
from .launch import check_mask_variant, generic_plan, mask_args, mask_params
from .masks import NONE, Masks
from .relayout import rows_copy

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
REGS_PER_SM = 65536
MAX_REGS = 240          # per thread under setmaxnreg (multiples of 8, at most 256; 240 leaves room)


def consumer_regs(variant: Variant) -> int:
    """Registers per thread of a consumer partition under setmaxnreg: what the loader warp group
    (4 warps: setmaxnreg acts per warpgroup) leaves, shared by the consumers' warps, rounded down
    to a multiple of 8, at most MAX_REGS. E.g. two 4-warp consumers, loader 24:
    (65536 - 128*24) / 256 = 244 -> 240. Without a loader partition (loader_regs 0) the consumers
    are all the threads and keep the even share, no less than the cap ptxas allocates under (two
    4-warp consumers: 256; a smaller setmaxnreg there makes ptxas spill to fit it)."""
    share = REGS_PER_SM - 128 * variant.loader_regs
    share //= 32 * variant.num_warps * consumers(variant)
    return min(256, share) // 8 * 8 if not variant.loader_regs else min(MAX_REGS, share // 8 * 8)


def unsupported(head_dim: int, dtype: torch.dtype, head_dims: tuple = HEAD_DIMS) -> str:
    """Why the kernels cannot serve this head dim / dtype ("" when they can); head_dims: the ones
    the family's kernels take (hopper_bwd's are fewer)."""
    if head_dim not in head_dims:
        return f"head dim {head_dim} is not one of {head_dims}"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not float16/bfloat16 (wgmma operands)"
    return ""


def _view3(t: torch.Tensor):
    """(shape, strides) of the (B*H, N, D) view of a (B, H, N, D) tensor, or None when the batch
    and head strides do not merge (a TMA descriptor has one stride per dim)."""
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    if sd != 1 or (b > 1 and sb != h * sh):
        return None
    return [b * h, n, d], [sh, sn, 1]


def _rows_view(t: torch.Tensor):
    """(shape, strides) of the (B, N, H*D) view of a (B, H, N, D) tensor whose heads lie side by
    side in each row ((B, N, H, D) memory, or a slice of a fused QKV projection), or None."""
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    if sd != 1 or (h > 1 and sh != d):
        return None
    return [b, n, h * d], [sb, sn, 1]


def kv_rows_copy(q: torch.Tensor, o: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q and O in (B, N, H, D) memory beside K and V in another layout (a transformers model's
    projections: q after RoPE keeps its projection's memory, k and v come back contiguous): the
    Hopper plans then copy K and V into q's layout each call (2 B x Hk x N x D each: a quarter
    of q's bytes at GQA 4:1) rather than hand the call to the generic families."""
    return (_rows_view(q) is not None and _rows_view(o) is not None
            and not (_rows_view(k) is not None and _rows_view(v) is not None))


def tile_view(*tensors: torch.Tensor):
    """The view every descriptor of a call takes: _view3 ((B*H, N, D): every render) where all
    the tensors allow it, else _rows_view ((B, N, H*D): bnhd renders, flashtune/gluon_tiles.py)
    where all allow that; None: neither (the generic family serves the call)."""
    for view in (_view3, _rows_view):
        if all(view(t) is not None for t in tensors):
            return view
    return None


def packed_view3(t: torch.Tensor):
    """(shape, strides) of the (H, total, D) view of a packed (total, H, D) tensor (varlen; TMA
    takes the strides in any order), or None without a contiguous last dim."""
    total, h, d = t.shape
    st, sh, sd = t.stride()
    return None if sd != 1 else ([h, total, d], [sh, st, 1])


def addressable(*tensors: torch.Tensor, view=_view3) -> bool:
    """TMA can address each tensor's `view` (_view3, _rows_view; packed_view3 for varlen):
    16-byte strides and base."""
    for t in tensors:
        v = view(t)
        if v is None or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in v[1][:2]):
            return False
    return True


def _device_blocker(device: torch.device) -> str:
    """Why the kernels cannot run on `device` ("" when they can): a GPU of sm_90, Gluon. Meta
    tensors pass: they are the search's compile-ahead (measure_warmup.compile_only: the JIT's
    warm-up compiles the launch's binary for the search's target and launches nothing)."""
    if device.type == "meta":
        return ""
    if device.type != "cuda":
        return "tensors are not on a GPU"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"the GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    from .gluon_compat import missing
    return missing()


def tile_layouts(dtype: torch.dtype, head_dim: int, *rows: int) -> dict:
    """The NVMMA shared layouts of the (1, r, D) TMA tiles of the Hopper families, per row count
    r (the kernels take one per distinct tile height)."""
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return {r: gl.NVMMASharedLayout.get_default_for([1, r, head_dim], gdt) for r in set(rows)}


def _sm_count(device: torch.device) -> int:
    if device.type == "meta":  # compile-ahead: the grid is no part of the binary
        return 1 << 30
    from .launch_splitkv import sm_count
    return sm_count(device)


class HopperFwdPlan:
    """One hopper_fwd launch fixed by the call's shapes, strides, dtype, causal, scale and masks
    (window / softcap / block mask: the variant must render exactly those, its tiles fitted to
    the block mask, dispatch.mask_twin);
    run(q, k, v) -> (O like q, LSE (B, H, Nq) float32), as launch.FwdPlan. `descriptor` is False:
    this plan checks the base addresses itself (ops.run_forward would otherwise swap the variant
    for a pointer twin, which this family has not)."""
    __slots__ = ("variant", "kernel", "grid", "scale", "n_tiles", "consts", "layouts", "fallback",
                 "why", "masks", "mask_args", "view", "copy_kv")
    descriptor = False

    def __init__(self, q, k, v, causal: bool, scale: float | None, variant: Variant,
                 masks: Masks = NONE):
        b, h, nq, d = q.shape
        check_mask_variant(variant, masks)
        if masks.block_mask is not None:
            from .families.hopper_fwd import fit_block_mask
            _, why = fit_block_mask(variant, masks.block_mask)
            if why:  # a tile walking two query blocks' lists would compute the wrong keys
                raise ValueError(f"{variant.name}: {why} (dispatch.mask_twin gives such a call "
                                 "the generic fwd default)")
        self.variant = variant
        self.masks = masks
        self.why = unsupported(d, q.dtype) or _device_blocker(q.device)
        o_meta = alloc.meta_like(q)
        self.view = tile_view(q, k, v, o_meta)
        self.copy_kv = self.view is None and kv_rows_copy(q, o_meta, k, v)
        if self.copy_kv:
            self.view = _rows_view
        if not self.why and self.view is None:
            self.why = "strides TMA cannot describe as (B*H, N, D), nor as (B, N, H*D), for all"
        elif not self.why and self.view is _rows_view:  # e.g. transformers' projections
            if max(b, h) >= 1 << 16:  # tile_at's batch << 16 | head
                self.why = "(B, N, H, D) memory with batch or heads past 65,535"
            else:
                variant = self.variant = dataclasses.replace(variant, bnhd=True)
        self.fallback = None
        if self.why:
            self.fallback = generic_plan(q, k, v, causal, scale, masks)
            return
        # the window's bounds (causal: its right edge 0), the softcap, the block mask's lists and
        # element mask, after sm_scale
        self.mask_args = mask_args(masks, causal, "q", b, h)
        self.layouts = tile_layouts(q.dtype, d, variant.block_m, variant.block_n)
        rows = variant.block_m * consumers(variant)
        n_tiles = triton.cdiv(nq, rows) * b * h
        programs = min(n_tiles, _sm_count(q.device)) if variant.persistent else n_tiles
        self.grid = (programs,)
        self.n_tiles = n_tiles
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.consts = dict(HEAD_DIM=d, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
                           STAGES=variant.num_stages, GROUP=h // k.shape[1], IS_CAUSAL=causal,
                           LOADER_REGS=variant.loader_regs, CONSUMER_REGS=consumer_regs(variant),
                           Q_BUFS=variant.q_buffers, num_warps=variant.num_warps,
                           **mask_params(masks))
        self.kernel = Launcher(load(variant).attn_fwd_hopper, **self.consts)

    def run(self, q, k, v):
        if self.fallback is not None:
            return self.fallback.run(q, k, v)
        o = alloc.empty_like(q)  # keeps q's layout, as the generic plan's
        if self.copy_kv:  # kv_rows_copy
            k, v = rows_copy(k), rows_copy(v)
        if not addressable(q, k, v, o, view=self.view):  # this call's bases only: no memo
            return generic_plan(q, k, v, self.consts["IS_CAUSAL"], self.scale,
                                 self.masks).run(q, k, v)
        b, h, nq, d = q.shape
        lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
        bm, bn = self.variant.block_m, self.variant.block_n

        def desc(t, rows):
            shape, strides = self.view(t)
            return gluon_desc(t, shape, strides, [1, rows, d], self.layouts[rows])
        self.kernel(self.grid, desc(q, bm), desc(k, bn), desc(v, bn), desc(o, bm), lse,
                    self.scale, *self.mask_args, h, nq, k.shape[2], self.n_tiles)
        return o, lse


def forward(q, k, v, causal: bool, scale: float | None, variant: Variant, masks: Masks = NONE):
    """Run a hopper_fwd variant: O (q's dtype and layout) and LSE (float32, (B, H, Nq)); masks:
    the call's window / softcap / block mask (validated, flashtune/masks.py), rendered in
    `variant`."""
    return HopperFwdPlan(q, k, v, causal, scale, variant, masks).run(q, k, v)
