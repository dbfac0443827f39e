"""torch.library ops `flashtune::attn_fwd` / `flashtune::attn_bwd` and their autograd formula.

Registered as custom ops (with fake implementations) so that torch.compile(fullgraph=True) and
CUDA graph capture see one opaque node per call: no graph breaks, shapes from the fakes. The
forward saves only q, k, v, O and the float32 row log-sum-exp: memory stays linear in seqlen.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import dispatch, launch, launch_bwd
from .codegen import Variant
from .defaults import default_variant
from .masks import NONE, Masks
from .problem import dtype_name, log2_bucket


# the bwd dQ schemes without atomics: the same inputs give the same gradients, bit for bit
DETERMINISTIC_DQ = ("separate", "fused", "gluon")

# call signature -> launch.FwdPlan: a repeated call costs a tuple, a dict lookup and the launch.
# Cleared with the dispatcher's lookups (a new tuned DB or table can change the variant).
_plans: dict = {}
dispatch.on_clear(_plans.clear)
# call signature -> backward plan (launch_bwd.BwdPlan, or a family's that serves bwd calls): the
# variant choice (select_bwd, mask_twin), constexprs and the masks' kernel arguments, built once
_bwd_plans: dict = {}
dispatch.on_clear(_bwd_plans.clear)
# _bucket_key -> a forward plan that serves any key count of its bucket (run_forward)
_bucket_plans: dict = {}
dispatch.on_clear(_bucket_plans.clear)
_PLANS_MAX = 4096


def _plan_key(q, k, v, causal: bool, scale, masks: Masks, variant, *extra) -> tuple:
    """A call's key in _plans / _bwd_plans: its signature and masks, and the variant given or
    force()d, which keeps its own plan too. Built on every call, a pinned variant's plan cost
    each call the host time of building it, which the GPU waits out when the kernel is short:
    benches that force a variant through the API (bwd_cands_bench.py's candidates,
    timer_agreement.py's API path) read such variants low against the dispatched path (session
    21: a forced bwd record read ~6% below the same kernel from its search's kept plan)."""
    return _masked_pinned((q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(),
                           v.stride(), causal, scale, *extra), masks, variant)


def _masked_pinned(key: tuple, masks: Masks, variant) -> tuple:
    """key, then the call's masks and the variant given or force()d (_plan_key, _bucket_key)."""
    if masks.any:
        key += masks.key
    pinned = variant if variant is not None else dispatch.forced_variant()
    return key if pinned is None else key + (pinned,)


def _bucket_key(q, k, v, causal: bool, scale, masks: Masks, variant) -> tuple:
    """A call's key in _bucket_plans: _plan_key with the key count as its bucket (log2) and the
    K/V strides as their layout and 16-byte alignment -- what a plan that serves every key count
    (`any_seqlen_k`) depends on, and the dispatcher's choice, up to the key count's exact value
    within its bucket."""
    def layout(t):  # heads outside tokens or not; TMA's 16-byte strides
        st = t.stride()
        return st[1] > st[2], st[3], (st[0] | st[1] | st[2]) * t.element_size() & 15 == 0
    return _masked_pinned((q.device, q.dtype, q.shape, q.stride(), k.shape[:2], k.shape[3:],
                           log2_bucket(k.shape[2]), layout(k), layout(v), causal, scale),
                          masks, variant)


def run_forward(q, k, v, causal: bool, scale, variant=None, masks: Masks = NONE):
    """Validated inputs -> (O, LSE). Handles the empty cases the kernel never sees.
    masks: window / softcap / block mask beyond causal (flashtune/masks.py), validated.
    A decoding loop over a growing cache (transformers' DynamicCache: a new key count, and new
    K/V strides, every step) finds its plan by the key count's bucket: a plan that serves any
    key count (splitkv's, `any_seqlen_k`) is built and chosen once per bucket, not per step."""
    key = _plan_key(q, k, v, causal, scale, masks, variant)
    plan = _plans.get(key)
    if plan is None:
        if q.numel() == 0 or k.shape[2] == 0:
            return _empty_forward(q, k)
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
            _bucket_plans.clear()
        bucket = _bucket_key(q, k, v, causal, scale, masks, variant)
        plan = _bucket_plans.get(bucket)
        if plan is None:
            if variant is None:  # the forced one, if it is fwd
                variant = dispatch.select_for_call("fwd", q, k, causal, masks)
            plan = _plan(q, k, v, causal, scale, variant, masks)
            if getattr(plan, "any_seqlen_k", False):
                _bucket_plans[bucket] = plan
        _plans[key] = plan
    if plan.descriptor and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        plan = _plan(q, k, v, causal, scale, dispatch.pointer_twin(plan.variant), masks)
    return plan.run(q, k, v)


def _plan(q, k, v, causal, scale, variant: Variant, masks: Masks = NONE):
    if masks.any:  # the masks rendered in (a family serving forwards that cannot: fwd's default)
        variant = dispatch.mask_twin(variant, masks, q.shape[3], q.dtype, "fwd")
    if variant.family != "fwd":  # a family that serves forwards (splitkv, hopper_fwd), its plan
        from .families import get
        return get(variant.family).plan_for(q, k, v, causal, scale, variant, masks)
    if variant.loads == "descriptor" and not launch.descriptor_ok(q, k, v):
        variant = dispatch.pointer_twin(variant)
    return launch.FwdPlan(q, k, v, causal, scale, variant, masks)


def _empty_forward(q, k):
    # nothing to attend to: zeros (a row that sees no key returns zeros), LSE = -inf
    return (torch.zeros_like(q),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))


def select_bwd(q, k, causal: bool, deterministic: bool, masks: Masks = NONE) -> Variant:
    """The dispatcher's bwd variant; deterministic=True swaps an atomic-dQ one for its separate
    twin (same dK/dV tiles, the dQ kernel's tiles from the built-in defaults)."""
    variant = dispatch.select_for_call("bwd", q, k, causal, masks)
    if variant.family != "bwd" and masks.any:
        # a family that serves bwd calls (hopper_bwd): its masked twin (Family.serve_masks),
        # else the bwd default's
        variant = dispatch.mask_twin(variant, masks, q.shape[3], q.dtype, "bwd")
    if deterministic:
        variant = deterministic_twin(variant, q.shape[3], q.dtype)
    if masks.any and variant.family == "bwd":
        variant = dispatch.mask_twin(variant, masks, q.shape[3], q.dtype)
    return variant  # a descriptor one runs as its pointer twin where TMA cannot (BwdPlan.run)


def deterministic_twin(variant: Variant, head_dim: int, dtype: torch.dtype) -> Variant:
    """What a deterministic=True backward runs for `variant`: itself when its dQ is
    deterministic; a bwd variant's separate twin; another family's atomic one (hopper_bwd
    dq="none"): the generic bwd default's separate twin."""
    if variant.dq in DETERMINISTIC_DQ:
        return variant
    if variant.family != "bwd":
        variant = default_variant("bwd", head_dim, dtype_name(dtype))
    return separate_twin(variant, head_dim, dtype)


def separate_twin(variant: Variant, head_dim: int, dtype: torch.dtype) -> Variant:
    """A bwd variant with a deterministic dQ ("separate" or "fused"): an atomic one gets the dQ
    kernel's tiles of the built-in defaults, its dK/dV tiles unchanged."""
    if variant.dq in DETERMINISTIC_DQ:
        return variant
    sep = default_variant("bwd", head_dim, dtype_name(dtype), dq="separate")
    return dataclasses.replace(variant, dq="separate", block_m2=sep.block_m2,
                               block_n2=sep.block_n2, num_warps2=sep.num_warps2,
                               num_stages2=sep.num_stages2)


def call_forced(forced, fn, *args):
    """fn(*args) with `forced` (a variant force()d around the forward, or None) pinned again:
    dispatch.force() is thread-local, but autograd runs CUDA backwards on its own thread. A
    variant forced where the backward runs (force() around it on the CPU's thread, or
    FLASHTUNE_FORCE_VARIANT) wins: a forward's forced fwd variant otherwise hid a bwd variant
    forced around the backward, which then ran as dispatched."""
    if forced is not None and dispatch.forced_variant() is None:
        with dispatch.force(forced):
            return fn(*args)
    return fn(*args)


def check_grad_output(grad_out, o) -> None:
    """A wrong grad_output gets an error naming it, never a kernel launch on bad memory."""
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_output must be a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.shape != o.shape:
        raise ValueError(f"grad_output has shape {tuple(grad_out.shape)} but the attention output "
                         f"has shape {tuple(o.shape)}")
    if grad_out.dtype != o.dtype:
        raise TypeError(f"grad_output.dtype ({grad_out.dtype}) must match the attention output's "
                        f"dtype ({o.dtype})")
    if grad_out.device != o.device:
        raise ValueError(f"grad_output is on {grad_out.device} but the attention output is on "
                         f"{o.device}")


def run_backward(grad_out, q, k, v, o, lse, causal: bool, scale, deterministic: bool = False,
                 variant=None, masks: Masks = NONE):
    """(dO, saved tensors) -> (dq, dk, dv) in the dtype and layout of q, k, v."""
    check_grad_output(grad_out, o)
    if q.numel() == 0 or k.numel() == 0:
        # no query or no key: every gradient is zero (or empty)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if grad_out.stride(-1) != 1:
        # e.g. the expanded ones of out.sum().backward() (all strides 0): the kernels need a
        # contiguous head dim
        grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    # a repeated call: a tuple, a dict lookup, the buffers and the launches
    key = _plan_key(q, k, v, causal, scale, masks, variant, deterministic)
    plan = _bwd_plans.get(key)
    if plan is None:
        if variant is None:
            variant = select_bwd(q, k, causal, deterministic, masks)
        elif deterministic and variant.dq not in DETERMINISTIC_DQ:
            raise ValueError(f"deterministic=True needs a dq in {DETERMINISTIC_DQ} variant, got "
                             f"{variant.name}")
        if len(_bwd_plans) >= _PLANS_MAX:
            _bwd_plans.clear()
        # a given variant runs as given (masks only where the call has some)
        plan = _bwd_plans[key] = _bwd_plan(q, k, v, causal, scale, variant, masks)
    return plan.run(grad_out, q, k, v, o, lse)


def _bwd_plan(q, k, v, causal, scale, variant: Variant, masks: Masks):
    """The launch plan of a bwd `variant` for this call: its family's own where it is another
    family that serves bwd calls (hopper_bwd), else launch_bwd's."""
    if variant.family != "bwd":
        from .families import get  # masks reach its plan only where the call has some
        return get(variant.family).plan_for(q, k, v, causal, scale, variant, masks)
    return launch_bwd.plan(q, k, causal, scale, variant, *((masks,) if masks.any else ()))


# -- torch.library registration ------------------------------------------------------------------

def op_masks(window_left: int, window_right: int, softcap) -> Masks:
    """The ops' flat mask arguments (window (-1, -1): none) as Masks."""
    window = None if window_left == window_right == -1 else (window_left, window_right)
    return Masks(window, softcap) if window is not None or softcap is not None else NONE


@torch.library.custom_op("flashtune::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: Optional[float], deterministic: bool, window_left: int = -1,
             window_right: int = -1,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, causal, scale, deterministic, window_left, window_right, softcap)


def _fwd_impl(q, k, v, causal, scale, deterministic, window_left=-1, window_right=-1,
              softcap=None):
    # `deterministic` is unused here; it rides along so the autograd formula can read it.
    # window / softcap: validated by the API (flashtune/masks.py), (-1, -1) = no window
    o, lse = run_forward(q, k, v, causal, scale,
                         masks=op_masks(window_left, window_right, softcap))
    return o, lse


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, causal, scale, deterministic, window_left=-1, window_right=-1,
                   softcap=None):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashtune::attn_bwd", mutates_args=())
def attn_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: Optional[float],
             deterministic: bool, window_left: int = -1, window_right: int = -1,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(grad_out, q, k, v, o, lse, causal, scale, deterministic, window_left,
                     window_right, softcap)


def _bwd_impl(grad_out, q, k, v, o, lse, causal, scale, deterministic, window_left=-1,
              window_right=-1, softcap=None):
    return run_backward(grad_out, q, k, v, o, lse, causal, scale, deterministic,
                        masks=op_masks(window_left, window_right, softcap))


@attn_bwd.register_fake
def _attn_bwd_fake(grad_out, q, k, v, o, lse, causal, scale, deterministic, window_left=-1,
                   window_right=-1, softcap=None):
    check_grad_output(grad_out, o)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic, *mask_args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    ctx.mask_args = tuple(mask_args)
    # dispatch.force() is thread-local, but autograd runs CUDA backwards on its own thread:
    # carry a variant forced around the forward over to the backward (debugging, benchmarks)
    ctx.forced = dispatch.forced_variant()
    ctx.mark_non_differentiable(lse)
    ctx.bwd = getattr(ctx, "bwd", attn_bwd)  # eager_autograd sets the implementation itself


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse = ctx.saved_tensors
    if grad_o is None:
        return (None,) * (6 + len(ctx.mask_args))
    dq, dk, dv = call_forced(ctx.forced, ctx.bwd, grad_o, q, k, v, o, lse, ctx.causal,
                             ctx.scale, ctx.deterministic, *ctx.mask_args)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            *(None,) * (3 + len(ctx.mask_args)))


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def eager_autograd(fwd, bwd, setup_context, backward):
    """apply(*inputs): a registered op's forward, setup_context and backward (as given to
    register_autograd) as a plain torch.autograd.Function that calls the implementations
    directly. Eager calls with gradients take it: the torch.library dispatch of an op pair cost
    about 0.2 ms of host time per forward + backward (kernels stubbed, tests' CPU), which an
    H100 bench showed at short sequences. torch.compile and CUDA graphs trace the ops."""
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out = fwd(*inputs)
            ctx.bwd = bwd
            # no zeros made for the outputs nobody differentiates (LSE): an allocation and a
            # fill kernel's launch per backward (the backward handles a missing grad itself)
            ctx.set_materialize_grads(False)
            setup_context(ctx, inputs, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)
    return Eager.apply


attn_fwd_eager = eager_autograd(_fwd_impl, _bwd_impl, _setup_context, _backward)


# -- block-sparse attention (flashtune.BlockMask) -------------------------------------------------
# The block mask travels as its flat tensors (BlockMask.op_args), so torch.compile and CUDA
# graphs see one opaque node here too.
def _sparse_masks(bm_args, window_left, window_right, softcap) -> Masks:
    from .block_mask import BlockMask
    window = None if window_left == window_right == -1 else (window_left, window_right)
    return Masks(window, softcap, BlockMask.from_op_args(*bm_args))


@torch.library.custom_op("flashtune::attn_sparse_fwd", mutates_args=())
def attn_sparse_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                    kv_num: torch.Tensor, kv_idx: torch.Tensor, full_kv_num: torch.Tensor,
                    full_kv_idx: torch.Tensor, q_num: torch.Tensor, q_idx: torch.Tensor,
                    full_q_num: torch.Tensor, full_q_idx: torch.Tensor,
                    elem: Optional[torch.Tensor], bs_q: int, bs_kv: int, nq: int, nk: int,
                    causal: bool, scale: Optional[float], deterministic: bool, window_left: int,
                    window_right: int,
                    softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _sparse_fwd_impl(q, k, v, state, kv_num, kv_idx, full_kv_num, full_kv_idx, q_num,
                            q_idx, full_q_num, full_q_idx, elem, bs_q, bs_kv, nq, nk, causal,
                            scale, deterministic, window_left, window_right, softcap)


def _sparse_fwd_impl(q, k, v, *rest):
    bm, (causal, scale, _deterministic, window_left, window_right, softcap) = rest[:14], rest[14:]
    o, lse = run_forward(q, k, v, causal, scale,
                         masks=_sparse_masks(bm, window_left, window_right, softcap))
    return o, lse


@attn_sparse_fwd.register_fake
def _attn_sparse_fwd_fake(q, k, v, *rest):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashtune::attn_sparse_bwd", mutates_args=())
def attn_sparse_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, state: torch.Tensor,
                    kv_num: torch.Tensor, kv_idx: torch.Tensor, full_kv_num: torch.Tensor,
                    full_kv_idx: torch.Tensor, q_num: torch.Tensor, q_idx: torch.Tensor,
                    full_q_num: torch.Tensor, full_q_idx: torch.Tensor,
                    elem: Optional[torch.Tensor], bs_q: int, bs_kv: int, nq: int, nk: int,
                    causal: bool, scale: Optional[float], deterministic: bool, window_left: int,
                    window_right: int, softcap: Optional[float]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _sparse_bwd_impl(grad_out, q, k, v, o, lse, state, kv_num, kv_idx, full_kv_num,
                            full_kv_idx, q_num, q_idx, full_q_num, full_q_idx, elem, bs_q, bs_kv,
                            nq, nk, causal, scale, deterministic, window_left, window_right,
                            softcap)


def _sparse_bwd_impl(grad_out, q, k, v, o, lse, *rest):
    bm, (causal, scale, deterministic, window_left, window_right, softcap) = rest[:14], rest[14:]
    return run_backward(grad_out, q, k, v, o, lse, causal, scale, deterministic,
                        masks=_sparse_masks(bm, window_left, window_right, softcap))


@attn_sparse_bwd.register_fake
def _attn_sparse_bwd_fake(grad_out, q, k, v, o, *rest):
    check_grad_output(grad_out, o)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sparse_setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    o, lse = output
    tensors = rest[:9]
    elem = rest[9]
    ctx.save_for_backward(q, k, v, o, lse, *tensors, *(() if elem is None else (elem,)))
    ctx.has_elem = elem is not None
    ctx.rest = tuple(rest[10:])  # bs_q, bs_kv, nq, nk, causal, scale, deterministic, window, cap
    ctx.forced = dispatch.forced_variant()
    ctx.mark_non_differentiable(lse)
    ctx.bwd = getattr(ctx, "bwd", attn_sparse_bwd)


def _sparse_backward(ctx, grad_o, grad_lse):
    n_in = 3 + 10 + len(ctx.rest)
    if grad_o is None:
        return (None,) * n_in
    saved = ctx.saved_tensors
    q, k, v, o, lse = saved[:5]
    tensors = saved[5:14]
    elem = saved[14] if ctx.has_elem else None
    dq, dk, dv = call_forced(ctx.forced, ctx.bwd, grad_o, q, k, v, o, lse, *tensors,
                             elem, *ctx.rest)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            *(None,) * (n_in - 3))


attn_sparse_fwd.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)


class _MaskedEager(torch.autograd.Function):
    """Eager calls with gradients and masks (window, softcap, block mask): the registered ops'
    formula, with the validated Masks carried as one object. A block mask's nine index tensors
    and element mask then neither pass through autograd's inputs and saved tensors nor are
    rebuilt into a BlockMask, forward and backward, on every call; the launch plans find the
    same Masks.key as the ops' path."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic, masks):
        o, lse = run_forward(q, k, v, causal, scale, masks=masks)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.deterministic, ctx.masks = causal, scale, deterministic, masks
        ctx.forced = dispatch.forced_variant()  # as _setup_context: autograd's own thread
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        if grad_o is None:
            return (None,) * 7
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = call_forced(ctx.forced, run_backward, grad_o, q, k, v, o, lse, ctx.causal,
                                 ctx.scale, ctx.deterministic, None, ctx.masks)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                None, None, None, None)


def attn_masked_eager(q, k, v, causal: bool, scale, deterministic: bool, masks: Masks):
    """(O, LSE) of an eager call with gradients and validated masks (api.attention)."""
    return _MaskedEager.apply(q, k, v, causal, scale, deterministic, masks)
