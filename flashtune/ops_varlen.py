"""torch.library ops `flashtune::attn_varlen_fwd` / `flashtune::attn_varlen_bwd` (packed
variable-length sequences) and their autograd formula, as ops.py does for the dense ops.

The offsets' values are checked here, in the ops' real implementations (one device->host copy
of cu_seqlens per new or changed offsets tensor, see validate_varlen and checked.py), so that
torch.compile traces the public function without a sync and still no kernel ever launches on bad
offsets.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch, launch
from .families import get as get_family
from .checked import CheckedValues
from .masks import NONE, Masks
from .ops import (_PLANS_MAX, call_forced, check_grad_output, deterministic_twin,
                  eager_autograd, op_masks)
from .problem import dtype_name
from .validate_varlen import check_cu_seqlens_values


def run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                       causal: bool, scale, masks: Masks = NONE):
    """Validated shapes -> (O like q, LSE float32 (H, total_q)). Checks the offsets' values."""
    total_q, h, _ = q.shape
    bounds = (max_seqlen_q, max_seqlen_k, total_q, k.shape[0])
    if _checked.get((cu_seqlens_q, cu_seqlens_k), bounds) is None:
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q,
                                k.shape[0])  # a device->host copy
        _checked.put((cu_seqlens_q, cu_seqlens_k), bounds, True)
    if total_q == 0 or k.shape[0] == 0:
        # no query, or no key anywhere: zeros (a row that sees no key returns zeros), LSE = -inf
        return (torch.zeros_like(q),
                torch.full((h, total_q), float("-inf"), dtype=torch.float32, device=q.device))
    batch = cu_seqlens_q.shape[0] - 1
    key = (q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), batch, max_seqlen_q,
           max_seqlen_k, causal, scale, dispatch.forced_variant(), masks.key)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        variant = dispatch.select_varlen("fwd", q, k, batch, max_seqlen_q, max_seqlen_k, causal)
        if variant.loads == "descriptor" and not _tma_strides(q, k, v):
            variant = dispatch.varlen_pointer_fallback("fwd", q.shape[2], dtype_name(q.dtype))
        plan = _plans[key] = _fwd_plan(variant, q, k, v, batch, max_seqlen_q, max_seqlen_k,
                                       causal, scale, masks)
    if plan.descriptor and (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        plan = _fwd_plan(dispatch.varlen_pointer_fallback("fwd", q.shape[2], dtype_name(q.dtype)),
                         q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, scale, masks)
    return plan.run(q, k, v, cu_seqlens_q, cu_seqlens_k)


def _fwd_plan(variant, q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, scale, masks):
    """The varlen fwd launch of `variant`, carrying the call's masks."""
    if masks.any:
        variant = dispatch.mask_twin(variant, masks, q.shape[2], q.dtype)
    return launch.VarlenFwdPlan(q, k, v, batch, max_seqlen_q, max_seqlen_k, causal, scale,
                                variant, masks)


def _tma_strides(*packed) -> bool:
    """Whether every packed (total, heads, D) tensor's strides suit TMA descriptors (bases are
    checked per call)."""
    return all(not ((t.stride(0) | t.stride(1)) * t.element_size()) & 15 for t in packed)


# offsets already checked: the layers of one step share cu_seqlens and pay for one sync
_checked = CheckedValues()

# call signature -> launch.VarlenFwdPlan (as ops.py's dense plans; cleared with the dispatcher)
_plans: dict = {}
dispatch.on_clear(_plans.clear)


def run_backward_varlen(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, scale, deterministic: bool = False,
                        masks: Masks = NONE):
    """(dO, saved tensors) -> (dq, dk, dv) like q, k, v. The offsets were checked by the forward."""
    check_grad_output(grad_out, o)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()  # e.g. the expanded ones of out.sum().backward()
    batch = cu_seqlens_q.shape[0] - 1
    forced = dispatch.forced_variant()
    # a repeated call (the layers of a step): a tuple, a dict lookup, the buffers and the launches
    key = (q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(), batch,
           max_seqlen_q, max_seqlen_k, causal, scale, deterministic, masks.key, forced)
    plan = _bwd_plans.get(key)
    if plan is None:
        # the generic bwd or a family serving its calls with varlen kernels (hopper_bwd, for
        # calls without masks beyond causal)
        variant = dispatch.select_varlen("bwd", q, k, batch, max_seqlen_q, max_seqlen_k, causal,
                                         masks)
        if deterministic:
            variant = dispatch.varlen_twin(deterministic_twin(variant, q.shape[2], q.dtype))
        if variant.descriptors:  # the generic varlen backward: pointer loads only
            variant = dispatch.pointer_twin(variant)
        if masks.any:
            variant = dispatch.mask_twin(variant, masks, q.shape[2], q.dtype)
        plan = get_family(variant.family).varlen_plan_for(
            q, k, batch, max_seqlen_q, max_seqlen_k, causal, scale, variant, masks)
        if len(_bwd_plans) >= _PLANS_MAX:
            _bwd_plans.clear()
        _bwd_plans[key] = plan
    return plan.run(grad_out, q, k, v, o, lse.contiguous(), (cu_seqlens_q, cu_seqlens_k))


# call signature -> launch_bwd.BwdPlan of the varlen backward (cleared with the dispatcher)
_bwd_plans: dict = {}
dispatch.on_clear(_bwd_plans.clear)


# -- torch.library registration ------------------------------------------------------------------

@torch.library.custom_op("flashtune::attn_varlen_fwd", mutates_args=())
def attn_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    causal: bool, scale: Optional[float],
                    deterministic: bool, window_left: int = -1, window_right: int = -1,
                    softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     scale, deterministic, window_left, window_right, softcap)


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
              deterministic, window_left=-1, window_right=-1, softcap=None):
    # `deterministic` is unused here; it rides along so the autograd formula can read it
    o, lse = run_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal, scale, op_masks(window_left, window_right, softcap))
    return o, lse


@attn_varlen_fwd.register_fake
def _attn_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          scale, deterministic, window_left=-1, window_right=-1, softcap=None):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attn_varlen_bwd", mutates_args=())
def attn_varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    causal: bool, scale: Optional[float],
                    deterministic: bool, window_left: int = -1, window_right: int = -1,
                    softcap: Optional[float] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, scale, deterministic, window_left, window_right, softcap)


def _bwd_impl(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, scale, deterministic, window_left=-1, window_right=-1, softcap=None):
    return run_backward_varlen(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, causal, scale, deterministic,
                               op_masks(window_left, window_right, softcap))


@attn_varlen_bwd.register_fake
def _attn_varlen_bwd_fake(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, scale, deterministic, window_left=-1,
                          window_right=-1, softcap=None):
    check_grad_output(grad_out, o)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, *mask_args = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, deterministic, *mask_args)
    ctx.forced = dispatch.forced_variant()  # carried to the backward's thread (ops.call_forced)
    ctx.mark_non_differentiable(lse)
    ctx.bwd = getattr(ctx, "bwd", attn_varlen_bwd)  # ops.eager_autograd sets run_backward_varlen


def _backward(ctx, grad_o, grad_lse):
    if grad_o is None:
        return (None,) * (5 + len(ctx.args))
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = call_forced(ctx.forced, ctx.bwd, grad_o, q, k, v, o, lse, cu_q, cu_k,
                             *ctx.args)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            *(None,) * (2 + len(ctx.args)))


attn_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)
attn_varlen_fwd_eager = eager_autograd(_fwd_impl, _bwd_impl, _setup_context, _backward)
