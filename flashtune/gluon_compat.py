"""The Gluon names the Hopper templates use that changed between the Triton releases flashtune
supports (3.6 on the GPU machines, 3.9 in CI), resolved once here so the templates stay
version-free. Imported by generated modules (`from flashtune.gluon_compat import ...`); the
aliases are Gluon's own builtins, so the JIT treats them as such.

    3.6                                   3.9
    tma.async_copy_global_to_shared       tma.async_load       (the old name raises in 3.9)
    tma.async_copy_shared_to_global       tma.async_store
    gl.thread_barrier                     gl.barrier

Both take warp_specialize([(fn, args), ...], worker_num_warps, worker_num_regs) (3.9 makes the
registers optional; the templates always pass them)."""
from __future__ import annotations

import functools

__all__ = ["available", "missing", "tma_load", "tma_store", "sync_warps"]

_NEEDED = ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma")


@functools.cache
def missing() -> str:
    """Why this Triton cannot build the Hopper Gluon kernels ("" when it can)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
    except Exception as e:  # noqa: BLE001 -- any import failure means: no Gluon here
        return f"this Triton has no Gluon ({type(e).__name__}: {e})"
    lacks = [n for n in _NEEDED if not hasattr(hopper, n)]
    if not hasattr(gl, "warp_specialize"):
        lacks.append("warp_specialize")
    if not (hasattr(hopper.tma, "async_load") or hasattr(hopper.tma,
                                                         "async_copy_global_to_shared")):
        lacks.append("tma loads")
    if not (hasattr(gl, "barrier") or hasattr(gl, "thread_barrier")):
        lacks.append("a CTA barrier")
    return f"this Triton's Gluon lacks {', '.join(lacks)}" if lacks else ""


def available() -> bool:
    return not missing()


if available():
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

    if hasattr(_tma, "async_load"):                       # 3.7+
        tma_load, tma_store = _tma.async_load, _tma.async_store
    else:                                                 # 3.6
        tma_load, tma_store = _tma.async_copy_global_to_shared, _tma.async_copy_shared_to_global
    sync_warps = _gl.barrier if hasattr(_gl, "barrier") else _gl.thread_barrier
