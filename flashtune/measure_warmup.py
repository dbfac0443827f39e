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
def compile_only(*launchers):
    """Route each launcher's `load` (the module a launcher gets its kernels from) to a _Warmup,
    so the launcher stays the one place that knows the kernels' arguments. Yields a dict whose
    "compiled" lists every kernel compiled, from each module the launchers loaded. Name every
    launcher module a plan loads through: hopper_bwd's dq="separate" plan builds the generic
    bwd's through launch_bwd.load, which otherwise launched for real on the meta tensors (a
    compile worker has no CUDA: "initialization error" on every masked dq="separate" trial of
    session 24's mask search)."""
    holder = {"compiled": []}
    with _patch_lock:
        real = [launcher.load for launcher in launchers]

        def fake_of(load):
            return lambda variant: _Warmup(load(variant), holder["compiled"])
        for launcher, load in zip(launchers, real):
            launcher.load = fake_of(load)
        try:
            yield holder
        finally:
            for launcher, load in zip(launchers, real):
                launcher.load = load


def max_shared(holder) -> int:
    """The largest metadata.shared among the kernels compiled (each must fit on its own)."""
    return max((int(getattr(k.metadata, "shared", 0)) for k in holder["compiled"]), default=0)
