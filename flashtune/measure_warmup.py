"""Compile-ahead through the JIT's own `warmup`: a family's launcher runs as usual on meta
tensors, but each `kernel[grid](...)` it makes compiles (same specialization and cache key as
the launch a timing worker makes later, so that one finds the binary in Triton's cache) and
launches nothing. Shared by the families' measuring operations (measure_fwd.py, measure_bwd.py).
"""
from __future__ import annotations

import contextlib
import threading

import torch

_patch_lock = threading.Lock()


class _Warmup:
    """Stands in for a generated module; `compiled` lists every kernel the launcher compiled."""

    def __init__(self, module, compiled: list):
        self._module = module
        self.compiled = compiled

    def __getattr__(self, name):
        fn = getattr(self._module, name)

        class _Indexed:
            def __getitem__(_, grid):
                def call(*args, **kwargs):
                    from triton.runtime.jit import MockTensor
                    args = [MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a
                            for a in args]
                    self.compiled.append(fn.warmup(*args, grid=grid, **kwargs))
                return call
        return _Indexed()


@contextlib.contextmanager
def compile_only(launcher):
    """Route `launcher.load` (the module a launcher gets its kernels from) to a _Warmup, so the
    launcher stays the one place that knows the kernels' arguments. Yields a dict whose
    "compiled" lists every kernel compiled, from each module the launcher loaded (hopper_bwd's
    plan loads its own and the generic bwd's preprocess)."""
    holder = {"compiled": []}
    with _patch_lock:
        real = launcher.load

        def fake(variant):
            return _Warmup(real(variant), holder["compiled"])
        launcher.load = fake
        try:
            yield holder
        finally:
            launcher.load = real


def max_shared(holder) -> int:
    """The largest metadata.shared among the kernels compiled (each must fit on its own)."""
    return max((int(getattr(k.metadata, "shared", 0)) for k in holder["compiled"]), default=0)
