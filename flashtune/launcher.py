"""Kernel launches with less host time: Triton's `kernel[grid](...)` binds and specializes every
argument on every call (21-24 us of host time for a trivial kernel with 8 arguments, 41-46 us
with 48, on the H100 machine: docs/benchmarks.md, session 14), which made a short backward
host-bound.

A `Launcher` holds one kernel and the keyword arguments a plan fixes (constexprs, num_warps,
num_stages). Its first launch goes through Triton (`JITFunction.run`: compile or cache lookup,
specialization); it keeps the compiled kernel it returns and the arguments Triton specialized it
on. Later launches call the compiled kernel's launcher directly -- what `JITFunction.run` itself
ends with -- as long as nothing Triton specializes on differs from that first launch:

- each tensor's dtype and 16-byte alignment of its address,
- an int's class as Triton specializes it (`int_class`: the value 1, a multiple of 16 or not,
  32-bit, 64-bit or unsigned 64-bit): a key count or stride that grows by one each decoding step
  stays on the direct path (it took Triton's path on every step, 20-45 us each, before),
- every other argument exactly (floats, None, bools, strings),
- a tensor descriptor's type, block shape, layout, shape, strides and base alignment,
- the current device, and no launch hooks installed (profilers such as proton).

Anything else takes Triton's path again, which picks or compiles the right kernel, so a launch
is never wrong, only sometimes slow. A launch whose tensors live on another GPU than the current
one makes theirs current first, as PyTorch's ops do (Triton launches on the current device).
Under the interpreter (`TRITON_INTERPRET=1`) and for anything that is not a Triton `JITFunction`,
every launch is Triton's. FLASHTUNE_SLOW_LAUNCH=1 turns the direct path off (to compare, or to
rule it out).
"""
from __future__ import annotations

import operator
from functools import lru_cache

import torch

from .env import slow_launch

_Tensor = torch.Tensor


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _on_device(device: int):
    return torch.cuda.device(device)


def _tensor_device(args) -> int:
    """The CUDA device of the first tensor (or descriptor's tensor) among args; -1: none, or a
    CPU tensor (the interpreter)."""
    for a in args:
        t = a if isinstance(a, _Tensor) else getattr(a, "base", None)
        if isinstance(t, _Tensor):
            return t.get_device()
    return -1


def _hooks_empty() -> bool:
    rt = _knobs().runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


@lru_cache(maxsize=1)
def _knobs():
    from triton import knobs  # imported once, not on every launch
    return knobs


def _desc_key(d) -> tuple | None:
    """What a host tensor descriptor's kernel depends on (None: not a descriptor)."""
    base = getattr(d, "base", None)
    if not isinstance(base, _Tensor) or not hasattr(d, "block_shape"):
        return None
    return (type(d), base.dtype, base.data_ptr() & 15 == 0, tuple(d.shape), tuple(d.strides),
            tuple(d.block_shape), getattr(d, "layout", None), getattr(d, "padding", None))


class Descriptors:
    """A plan's per-call host TMA descriptors at a copy's cost. Gluon's TensorDescriptor checks
    its arguments on construction (9 us each under cProfile on the H100 machine, and a backward
    built 7 to 11 a call: bench/host_bwd.py). The first descriptor of each (dtype, shape,
    strides, block shape, layout) is built and checked by Gluon and kept without its tensor;
    later calls copy it with the call's tensor as base. The base's 16-byte alignment, the one
    check that depends on the tensor, is the caller's (launch_hopper.addressable), as before any
    launch. A copy carries its template's key (`ft_sig`), by which Launcher._same knows it
    without rebuilding the key."""
    __slots__ = ("cls", "templates")

    def __init__(self, cls):
        self.cls, self.templates = cls, {}

    def __call__(self, t: torch.Tensor, shape, strides, block_shape, layout):
        key = (t.dtype, *shape, *strides, *block_shape, id(layout))
        tmpl = self.templates.get(key)
        if tmpl is None:
            made = self.cls(t, shape, strides, block_shape, layout)  # Gluon's checks, once
            tmpl = object.__new__(made.__class__)
            tmpl.__dict__.update(made.__dict__, base=None, ft_sig=_desc_key(made))
            if len(self.templates) >= 1024:  # a few per plan; never unbounded
                self.templates.clear()
            self.templates[key] = tmpl
        d = object.__new__(tmpl.__class__)
        d.__dict__.update(tmpl.__dict__)
        d.base = t
        return d


_gluon: list = []


def gluon_desc(t: torch.Tensor, shape, strides, block_shape, layout):
    """Gluon's host TensorDescriptor(t, shape, strides, block_shape, layout) through one shared
    Descriptors (the Hopper plans' per-call descriptors)."""
    if not _gluon:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        _gluon.append(Descriptors(TensorDescriptor))
    return _gluon[0](t, shape, strides, block_shape, layout)


class Launcher:
    """One kernel's launches with fixed keyword arguments: `launcher(grid, *args)` is
    `fn[grid](*args, **kwargs)`, after the first call without Triton's per-call binding."""
    __slots__ = ("fn", "kwargs", "kernel", "tail", "nargs", "device", "tensors", "descs",
                 "exact_get", "exact", "direct", "int_mask")

    def __init__(self, fn, **kwargs):
        self.fn, self.kwargs, self.kernel = fn, kwargs, None
        self.direct = _direct_ok(fn)

    def __call__(self, grid, *args):
        k = self.kernel
        if k is not None and self._same(args):
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            k.run(grid[0], g1, g2, _current_stream(self.device), k.function, k.packed_metadata,
                  None, None, None, *args, *self.tail)
            return
        # Triton launches on the current device: a call whose tensors live on another one (a
        # model spread over GPUs, no torch.cuda.set_device) runs with that device current, as
        # PyTorch's own ops do
        dev = _tensor_device(args)
        if dev >= 0 and dev != _current_device():
            with _on_device(dev):
                return self(grid, *args)
        kernel = self.fn[grid](*args, **self.kwargs)
        if self.direct and k is None:
            self._capture(kernel, args)

    def _same(self, args) -> bool:
        if len(args) != self.nargs or _current_device() != self.device:
            return False
        for i, dt, aligned in self.tensors:
            a = args[i]
            if a.__class__ is not _Tensor and not isinstance(a, _Tensor):
                return False
            if a.dtype is not dt or (a.data_ptr() & 15 == 0) is not aligned:
                return False
        for i, key in self.descs:
            d = args[i]
            if getattr(d, "ft_sig", None) is key:  # a copy of the template captured: its base
                if (d.base.data_ptr() & 15 == 0) is not key[2]:
                    return False
            elif _desc_key(d) != key:
                return False
        if self.exact_get is not None:
            cur = self.exact_get(args)
            if cur != self.exact:
                # an int changed (a decoding step's key count, a growing cache's strides): the
                # same kernel while Triton would specialize it the same way
                for a, b, is_int in zip(cur, self.exact, self.int_mask):
                    if a is not b and (type(a) is not type(b) or a != b and not (
                            is_int and int_class(a) == int_class(b))):
                        return False
                self.exact = cur  # the next call like this one: the first test
        return _hooks_empty()

    def _capture(self, kernel, args) -> None:
        """Keep the kernel Triton launched and what it was specialized on; on anything
        unexpected (another Triton's internals), stay on Triton's path."""
        try:
            if kernel is None or not _hooks_empty():
                return
            if hasattr(kernel, "result"):  # an asynchronous compile's future (triton 3.6)
                kernel = kernel.result()
            device = _current_device()
            binder = self.fn.device_caches[device][4]
            bound = list(binder(*args, **self.kwargs)[0].values())
            if len(bound) < len(args) or any(b is not a for b, a in zip(bound, args)):
                return
            tensors, descs, exact = [], [], []
            for i, a in enumerate(args):
                if isinstance(a, _Tensor):
                    tensors.append((i, a.dtype, a.data_ptr() & 15 == 0))
                elif (key := _desc_key(a)) is not None:
                    sig = getattr(a, "ft_sig", None)  # Descriptors' copies: known by identity
                    descs.append((i, sig if sig == key else key))
                elif a is None or isinstance(a, (bool, int, float, str)):
                    exact.append(i)
                else:  # something whose specialization we cannot tell: Triton's path
                    return
            kernel.function  # noqa: B018 -- the handles exist (loaded by this launch)
            # a tuple of those arguments, however many (itemgetter of one index gives the item)
            self.exact_get = (None if not exact else operator.itemgetter(*exact)
                              if len(exact) > 1 else (lambda a, i=exact[0]: (a[i],)))
            self.exact = self.exact_get(args) if exact else None
            self.int_mask = tuple(type(args[i]) is int for i in exact)
            self.tensors, self.descs = tuple(tensors), tuple(descs)
            self.tail, self.nargs, self.device = tuple(bound[len(args):]), len(args), device
            self.kernel = kernel
        except Exception:  # noqa: BLE001 -- the direct path is an optimisation, never a failure
            self.kernel = None
            self.direct = False


def int_class(x):
    """What Triton's launch specializes an int argument on (triton 3.6 and 3.9, whose
    native_specialize_impl gives ("constexpr", 1) for 1, else ("i32" | "i64" | "u64", "D" for a
    multiple of 16)): two ints of one class run the same compiled kernel. Anything that is not
    an int (a bool included) is its own class. tests/test_launcher.py checks this against the
    installed Triton's own function."""
    if type(x) is not int:
        return (type(x), x)
    if x == 1:
        return 1
    return (x % 16 == 0, 0 if -2**31 <= x < 2**31 else 1 if x < 2**63 else 2)


def _direct_ok(fn) -> bool:
    if slow_launch():
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(fn, JITFunction) and hasattr(fn, "device_caches")
