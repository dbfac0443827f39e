"""Launch a generated kernel for one problem: grid, strides, constexprs. No policy here."""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import torch
import triton

from . import alloc
from .codegen import Variant, load
from .launcher import Launcher
from .masks import NONE, Masks, kernel_window

_DOT_PRECISION = {torch.float32: "ieee"}  # float32 stays float32; fp16/bf16 ignore the setting


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


_allocator_threads = threading.local()


def _need_allocator() -> None:
    """Tensor descriptors built inside a kernel need a global scratch allocator. Triton keeps it
    in a ContextVar, which a new thread starts without: set once per thread (autograd runs CUDA
    backwards on its own thread, where a backward's descriptors found none)."""
    if not getattr(_allocator_threads, "set", False):
        triton.set_allocator(_alloc)
        _allocator_threads.set = True


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream: nothing made now may be
    kept past the call (it lives in the graph's memory pool, which torch.compile's CUDA graph
    trees check), so memos of tensors skip it."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def descriptor_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and strides (all but the last dim)."""
    for t in tensors:
        s = t.stride()
        # element sizes are powers of two, so OR-ing the strides keeps the low bits that matter
        if t.data_ptr() & 15 or ((s[0] | s[1] | s[2]) * t.element_size()) & 15:
            return False
    return True


def strides3(*tensors) -> tuple:
    """The batch, head and row strides of each (B, H, N, D) tensor, flattened: the kernels'
    stride arguments (the head-dim stride is 1 by validation)."""
    return tuple(s for t in tensors for s in t.stride()[:3])


@lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return ("launch_pdl" in CUDAOptions.__dataclass_fields__
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def pdl_ok(device: torch.device) -> bool:
    """Whether a kernel may be launched as a programmatic dependent of the one before it
    (`launch_pdl`): sm_90+, a Triton that knows the option, not the interpreter, not turned
    off (FLASHTUNE_PDL=0)."""
    from .env import no_pdl
    if device.type != "cuda" or no_pdl():
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def fwd_params(variant: Variant, dtype: torch.dtype, head_dim: int, causal: bool, group: int,
               even_n: bool) -> dict:
    """The fwd kernel's constexprs and launch knobs (dense and varlen launches share them)."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=variant.block_m,
        BLOCK_N=variant.block_n, IS_CAUSAL=causal, GROUP=group, EVEN_N=even_n,
        DOT_PRECISION=_DOT_PRECISION.get(dtype, "tf32"), PRECISE=dtype == torch.float32,
        num_warps=variant.num_warps, num_stages=variant.num_stages)


def mask_args(masks: Masks, causal: bool, kernel: str, b: int, h: int) -> tuple:
    """The runtime arguments the templates take after sm_scale for `masks`, in their order:
    window (left, right), softcap, then the block mask's tensors and sizes. kernel: "q" (a kernel
    over query blocks: fwd, dQ -- the per-query-block key lists), "kv" (dK/dV: the per-key-block
    query lists) or "state" (the float32 preprocess: the dense block states)."""
    out: list = []
    if masks.any:  # every masked variant takes the window's bounds (the template's `masked`)
        out += kernel_window(masks.window or (-1, 0 if causal else -1))
    if masks.softcap is not None:
        out.append(masks.softcap)
    bm = masks.block_mask
    if bm is not None:
        bmb, bmh = bm.state.shape[:2]
        sb, sh = (bmh if bmb > 1 else 0), (1 if bmh > 1 else 0)
        nqb, nkb = bm.state.shape[2:]
        if kernel in ("q", "kv"):
            out += block_lists(bm, kernel)
            if kernel == "kv":
                nqb, nkb = nkb, nqb  # rows of the lists are key blocks, their entries query blocks
        else:
            out += [bm.state]
        if bm.mask is not None:
            em = bm.mask.expand(b, h, *bm.seq_lengths)
            em_strides = em.stride()
            em = em.view(torch.uint8)
        else:
            em, em_strides = bm.state, (0, 0, 0, 0)
        out += [em, sb, sh, nqb, nkb, *em_strides]
    return tuple(out)


def block_lists(bm, kernel: str) -> list:
    """A BlockMask's (num, indices, full num, full indices) lists for a kernel over query blocks
    ("q": each one's key blocks) or over key blocks ("kv": each one's query blocks)."""
    if kernel == "q":
        return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
    return [bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices]


def mask_params(masks: Masks) -> dict:
    """The block-sparse constexprs (none for the other masks)."""
    bm = masks.block_mask
    if bm is None:
        return {}
    return dict(BS_Q=bm.block_size[0], BS_KV=bm.block_size[1], ELEM=bm.mask is not None)


def example_masks(variant: Variant, causal: bool = False) -> dict:
    """The mask constexprs a launch of `variant` would take, for compiling without a GPU
    (compile checks): a block mask of 128-blocks (or the tiles, if larger) with an element mask."""
    if not variant.block_sparse:
        return {}
    return dict(BS_Q=max(128, variant.block_m, variant.block_m2),
                BS_KV=max(128, variant.block_n, variant.block_n2), ELEM=True)


def check_mask_variant(variant: Variant, masks: Masks) -> None:
    """A variant renders exactly the mask code the call needs (dispatch.mask_twin makes one)."""
    if variant.masks != tuple(m for m, on in masks.structure.items() if on):
        raise ValueError(f"variant {variant.name} carries masks {variant.masks} but the call "
                         f"needs {tuple(m for m, on in masks.structure.items() if on)} "
                         "(use dispatch.mask_twin)")
    bm = masks.block_mask
    if bm is not None and (variant.block_m > bm.block_size[0]
                           or variant.block_n > bm.block_size[1]):
        raise ValueError(f"variant {variant.name}: block_m/block_n must divide the block mask's "
                         f"block_size {bm.block_size} (use dispatch.mask_twin)")


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, D) tensor as the (1, heads, total, D) view whose head and row
    strides the kernels take (stride_*b is unused by varlen renders)."""
    return t.transpose(0, 1).unsqueeze(0)


def check_varlen_variant(variant: Variant) -> None:
    if not variant.varlen:
        raise ValueError(f"variant {variant.name}: a varlen launch needs varlen=True "
                         "(use dispatch.varlen_twin)")


class FwdPlan:
    """Everything about one fwd launch that depends only on the call's shapes, strides, dtype,
    causal and scale -- built once per such call signature, so a repeated call pays for two
    allocations and the launch. `aligned` says whether its tensors' strides suit TMA; the
    base addresses are checked per call."""
    __slots__ = ("variant", "kernel", "grid", "args", "kwargs", "lse_shape", "descriptor")

    def __init__(self, q, k, v, causal: bool, scale: float | None, variant: Variant,
                 masks: Masks = NONE):
        b, h, nq, d = q.shape
        nk = k.shape[2]
        check_mask_variant(variant, masks)
        o_strides = alloc.like_strides(q)  # the layout forward() allocates
        self.variant = variant
        self.grid = (triton.cdiv(nq, variant.block_m) * b * h,)
        self.lse_shape = (b, h, nq)
        self.descriptor = variant.loads == "descriptor"
        self.args = (_scale(scale, d), *mask_args(masks, causal, "q", b, h), *strides3(q, k, v),
                     *o_strides[:3], h, nq, nk)
        # a block mask's loop steps through whole blocks: even only if they tile the keys
        step = variant.block_n if masks.block_mask is None else masks.block_mask.block_size[1]
        self.kwargs = fwd_params(variant, q.dtype, d, causal, h // k.shape[1],
                                 even_n=nk % max(step, variant.block_n) == 0)
        self.kwargs.update(mask_params(masks))
        self.kernel = Launcher(load(variant).attn_fwd, **self.kwargs)

    def run(self, q, k, v):
        o = alloc.empty_like(q)  # keeps q's layout when dense: (B, N, H, D) views stay so
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.descriptor:
            _need_allocator()
        self.kernel(self.grid, q, k, v, o, lse, *self.args)
        return o, lse


def generic_plan(q, k, v, causal: bool, scale, masks: Masks = NONE) -> FwdPlan:
    """The generic fwd family's default for this call (what the dispatcher would have chosen
    without a rival family) with the call's masks rendered in, pointer loads where TMA cannot
    address the tensors: the plan of a served call another family's plan cannot take."""
    from .defaults import default_variant
    from .dispatch import mask_twin, pointer_twin
    from .problem import dtype_name
    fv = default_variant("fwd", q.shape[3], dtype_name(q.dtype))
    if masks.any:
        fv = mask_twin(fv, masks, q.shape[3], q.dtype)
    if fv.loads == "descriptor" and not descriptor_ok(q, k, v):
        fv = pointer_twin(fv)
    return FwdPlan(q, k, v, causal, scale, fv, masks)


def forward(q, k, v, causal: bool, scale: float | None, variant: Variant, masks: Masks = NONE):
    """Run the fwd variant: returns O (q's dtype, (B, H, Nq, D)) and LSE (float32, (B, H, Nq))."""
    return FwdPlan(q, k, v, causal, scale, variant, masks).run(q, k, v)


class VarlenFwdPlan:
    """A varlen fwd launch (packed q (total_q, H, D), k, v (total_k, Hk, D)) fixed by shapes,
    strides, dtype, causal, scale, batch and max seqlens: built once per such signature."""
    __slots__ = ("variant", "kernel", "grid", "args", "kwargs", "lse_shape", "descriptor")

    def __init__(self, q, k, v, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                 scale: float | None, variant: Variant, masks: Masks = NONE):
        check_varlen_variant(variant)
        check_mask_variant(variant, masks)
        if masks.block_mask is not None:
            raise ValueError("block_mask is not supported with packed variable-length sequences")
        total_q, h, d = q.shape
        o_strides = alloc.meta_like(q)
        self.variant = variant
        self.descriptor = variant.loads == "descriptor"  # callers check base addresses per call
        self.grid = (triton.cdiv(max_seqlen_q, variant.block_m) * batch * h,)
        self.lse_shape = (h, total_q)
        self.args = (_scale(scale, d), *mask_args(masks, causal, "q", 1, h),
                     *strides3(packed_view(q), packed_view(k), packed_view(v),
                               packed_view(o_strides)),
                     h, max_seqlen_q, max_seqlen_k, total_q, k.shape[0])
        self.kwargs = fwd_params(variant, q.dtype, d, causal, h // k.shape[1], even_n=False)
        self.kernel = Launcher(load(variant).attn_fwd, **self.kwargs)

    def run(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        o = alloc.empty_like(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.descriptor:
            _need_allocator()
        self.kernel(self.grid, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *self.args)
        return o, lse


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                   causal: bool, scale: float | None, variant: Variant, masks: Masks = NONE):
    """Run a varlen fwd variant on packed q (total_q, H, D), k, v (total_k, Hk, D) with int32
    cu_seqlens (batch + 1) already validated: returns O (like q) and LSE (float32, (H, total_q)).
    The grid covers max_seqlen_q; blocks past their sequence's end exit at once."""
    return VarlenFwdPlan(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, causal,
                         scale, variant, masks).run(q, k, v, cu_seqlens_q, cu_seqlens_k)
