"""launcher.Launcher: Triton's path first, the compiled kernel's launcher directly afterwards, and
Triton's path again whenever an argument Triton specializes on differs (CPU: a stand-in
JITFunction records which path each launch took; GPU: real kernels, results against the float64
reference, misaligned and re-dtyped inputs)."""
from __future__ import annotations

import pytest
import torch

from flashtune import launcher as L


class _Kernel:
    """A compiled kernel's stand-in: run() records the direct launches."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_md, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), stream, args))


def _fake_jit(log, tail=("C",), bind_ok=True):
    from triton.runtime.jit import JITFunction

    class Fake(JITFunction):
        def __init__(self):  # noqa: D401 -- no source to parse
            self.kernel = _Kernel(log)

            def binder(*args, **kwargs):
                vals = list(args) if bind_ok else [object() for _ in args]
                bound = {f"a{i}": a for i, a in enumerate(vals)}
                bound.update({f"c{i}": kwargs.get(t, t) for i, t in enumerate(tail)})
                return bound, None, None
            self.device_caches = {0: (None, None, None, None, binder)}

        def __getitem__(self, grid):
            def call(*args, **kwargs):
                log.append(("triton", grid, args, kwargs))
                return self.kernel
            return call
    return Fake()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_current_stream", lambda device: 1234)
    monkeypatch.delenv("FLASHTUNE_SLOW_LAUNCH", raising=False)


def _tensors():
    buf = torch.randn(64, dtype=torch.float16)
    return buf[:32], torch.randn(8, 4)


def _paths(log):
    return [e[0] for e in log]


def test_first_launch_through_triton_then_direct(fake_cuda):
    log = []
    lau = L.Launcher(_fake_jit(log), C=7, num_warps=4)
    x, y = _tensors()
    lau((3,), x, y, 16, 0.5, None)
    lau((5, 2), x, y, 16, 0.5, None)
    assert _paths(log) == ["triton", "direct"]
    assert log[0][3] == {"C": 7, "num_warps": 4}  # Triton's path gets the fixed kwargs
    _, grid, stream, args = log[1]
    assert grid == (5, 2, 1) and stream == 1234
    assert args[:5] == (x, y, 16, 0.5, None) and args[5:] == (7,)  # the bound tail follows


def test_each_specialization_change_takes_triton_path(fake_cuda):
    log = []
    lau = L.Launcher(_fake_jit(log))
    x, y = _tensors()
    lau((1,), x, y, 16, 0.5)
    misaligned = torch.randn(64, dtype=torch.float16)[1:33]  # 2-byte offset
    assert misaligned.data_ptr() % 16 != 0
    calls = [
        (misaligned, y, 16, 0.5),          # a tensor's alignment
        (x.float(), y, 16, 0.5),           # a tensor's dtype
        (x, y, 17, 0.5),                   # an int
        (x, y, 16, 0.25),                  # a float
        (x, y, 16),                        # the argument count
        (x, None, 16, 0.5),                # a tensor became None
        (x, y, 16, 0.5),                   # as the first: direct
    ]
    for args in calls:
        lau((1,), *args)
    assert _paths(log) == ["triton"] * 7 + ["direct"]


def test_an_int_triton_specializes_alike_stays_direct(fake_cuda):
    """A key count or stride that grows each decoding step: the compiled kernel serves every int
    Triton would specialize the same way (int_class); one it would not takes Triton's path."""
    log = []
    lau = L.Launcher(_fake_jit(log))
    x, y = _tensors()
    for n in (32, 48, 17, 33, 2048, 1, 2**31 + 16, 4096):
        lau((1,), x, y, n, 0.5)
    # 16-multiples like the first (32) direct; 17, 33 (not), 1 (a constant), 2**31 + 16 (64-bit)
    assert _paths(log) == ["triton", "direct", "triton", "triton", "direct", "triton", "triton",
                           "direct"]
    assert [e[3][2] for e in log if e[0] == "direct"] == [48, 2048, 4096]  # the call's own value
    # a bool where the int was, or another float, is Triton's too
    lau((1,), x, y, True, 0.5)
    lau((1,), x, y, 64, 0.25)
    assert _paths(log)[-2:] == ["triton", "triton"]


def test_int_class_is_the_installed_tritons_specialization():
    """int_class(a) == int_class(b) only where Triton's own specialization of a and b agrees (the
    direct path may only run a kernel Triton would have picked for those values), and for ints
    exactly there (bools stay exact: stricter than Triton)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    values = [0, 1, 2, 3, 15, 16, 17, 31, 32, 48, 1000, 1024, 2**20 + 1, 2**31 - 16, 2**31 - 1,
              2**31, 2**31 + 1, 2**31 + 16, 2**32, 2**40 + 3, 2**63 - 16, 2**63, 2**63 + 16,
              2**64 - 1, -1, -2, -16, -17, -2**31, -2**31 - 1, -2**31 - 16, -2**40, True, False]
    triton_key = {repr(v): native_specialize_impl(BaseBackend, v, False, True, True)
                  for v in values}
    for a in values:
        for b in values:
            same = triton_key[repr(a)] == triton_key[repr(b)]
            if L.int_class(a) == L.int_class(b):
                assert same, (a, b)
            elif type(a) is int and type(b) is int:
                assert not same, (a, b)


def test_launch_hooks_and_device_change_take_triton_path(fake_cuda, monkeypatch):
    from triton import knobs
    log = []
    lau = L.Launcher(_fake_jit(log))
    x, y = _tensors()
    lau((1,), x, y)
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        seen = []
        hook.add(seen.append)
        try:
            lau((1,), x, y)
        finally:
            hook.remove(seen.append)
    else:  # a Triton whose hook is one callable or None
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda md: None)
        lau((1,), x, y)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert _paths(log) == ["triton", "triton"]
    monkeypatch.setattr(L, "_current_device", lambda: 1)
    lau((1,), x, y)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    lau((1,), x, y)
    assert _paths(log) == ["triton", "triton", "triton", "direct"]


def test_a_call_on_another_gpu_makes_that_gpu_current(fake_cuda, monkeypatch):
    """Tensors on GPU 1 while GPU 0 is current (a model spread over GPUs): every launch, Triton's
    and the direct ones, runs with GPU 1 current, and GPU 0 is current again afterwards."""
    import contextlib
    current = [0]
    seen = []

    @contextlib.contextmanager
    def on_device(d):
        prev, current[0] = current[0], d
        try:
            yield
        finally:
            current[0] = prev
    monkeypatch.setattr(L, "_current_device", lambda: current[0])
    monkeypatch.setattr(L, "_on_device", on_device)
    monkeypatch.setattr(L, "_tensor_device", lambda args: 1)
    log = []
    fake = _fake_jit(log)
    fake.device_caches[1] = fake.device_caches[0]
    real_run = fake.kernel.run
    fake.kernel.run = lambda *a: (seen.append(current[0]), real_run(*a))
    real_getitem = type(fake).__getitem__
    type(fake).__getitem__ = lambda self, grid: (seen.append(current[0]),
                                                 real_getitem(self, grid))[1]
    lau = L.Launcher(fake)
    x, y = _tensors()
    for _ in range(3):
        lau((1,), x, y)
    assert _paths(log) == ["triton", "direct", "direct"]
    assert seen == [1, 1, 1] and current[0] == 0 and lau.device == 1


def test_no_direct_path_when_it_cannot_be_trusted(fake_cuda, monkeypatch):
    x, y = _tensors()
    # the binder does not hand back the arguments as given
    log = []
    lau = L.Launcher(_fake_jit(log, bind_ok=False))
    for _ in range(3):
        lau((1,), x, y)
    assert _paths(log) == ["triton"] * 3
    # an argument whose specialization it cannot tell
    log = []
    lau = L.Launcher(_fake_jit(log))
    for _ in range(3):
        lau((1,), x, y, object())
    assert _paths(log) == ["triton"] * 3
    # switched off
    monkeypatch.setenv("FLASHTUNE_SLOW_LAUNCH", "1")
    log = []
    lau = L.Launcher(_fake_jit(log))
    for _ in range(3):
        lau((1,), x, y)
    assert _paths(log) == ["triton"] * 3


def test_capture_failure_is_not_an_error(fake_cuda, monkeypatch):
    def boom():
        raise RuntimeError("no CUDA")
    log = []
    lau = L.Launcher(_fake_jit(log))
    monkeypatch.setattr(L, "_current_device", boom)
    x, y = _tensors()
    lau((1,), x, y)
    lau((1,), x, y)
    assert _paths(log) == ["triton", "triton"] and not lau.direct


def test_non_jit_functions_always_take_their_own_path():
    log = []

    class Indexed:  # measure_warmup's compile-only stand-in, the interpreter's function
        def __getitem__(self, grid):
            return lambda *a, **k: log.append(grid)
    lau = L.Launcher(Indexed(), C=1)
    lau((2,), 1)
    lau((3,), 1)
    assert log == [(2,), (3,)] and lau.kernel is None


def _ref_attention(q, k, v, causal):
    from flashtune.reference import reference
    return reference(q, k, v, causal=causal).double()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_direct_launches_match_triton_path(causal):
    """Repeated calls (direct launches) give the first call's results bit for bit; a misaligned
    view and a float16 call between them take Triton's path and are right too."""
    import flashtune
    from flashtune import ops
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 384, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, g):
        o = flashtune.attention(q, k, v, causal=causal)
        return (o, *torch.autograd.grad(o, (q, k, v), g))
    first = step(q, k, v, g)
    again = [step(q, k, v, g) for _ in range(3)]
    for got in again:
        for a, c in zip(got, first):
            assert torch.equal(a, c)
    direct = [x for p in list(ops._plans.values()) + list(ops._bwd_plans.values())
              for x in _launchers(p) if x.kernel is not None]
    assert direct, "no plan kept a compiled kernel: the direct path never ran"
    ref = _ref_attention(q, k, v, causal)
    assert (first[0].double() - ref).abs().max() < 2e-2
    # a view 2 bytes off 16-byte alignment: Triton's path (another specialization)
    for dt in (torch.bfloat16, torch.float16):
        big = torch.randn(b * h * n * d + 1, device="cuda", dtype=dt)
        qm = big[1:].view(b, h, n, d)
        assert qm.data_ptr() % 16 != 0
        km, vm = k.detach().to(dt), v.detach().to(dt)
        for _ in range(2):
            o = flashtune.attention(qm, km, vm, causal=causal)
            assert (o.double() - _ref_attention(qm, km, vm, causal)).abs().max() < 2e-2


def _launchers(plan) -> list:
    """The Launchers a plan holds (its own, its fallback's, a wrapped plan's)."""
    got = []
    for name in ("kernel", "kernels", "pre", "fallback", "plan", "_launchers"):
        x = getattr(plan, name, None)
        items = x.values() if isinstance(x, dict) else x if isinstance(x, tuple) else [x]
        for y in items:
            if isinstance(y, L.Launcher):
                got.append(y)
            elif y is not None and name in ("fallback", "plan"):
                got += _launchers(y)
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_gpu_tensors_on_the_second_gpu_with_the_first_current():
    import flashtune
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    dev = torch.device("cuda", 1)
    q, k, v = (torch.randn(1, 4, 256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for _ in range(3):  # the first launch and direct ones
        o = flashtune.attention(q, k, v, causal=True)
        dq, = torch.autograd.grad(o.float().square().sum(), (q,))
    assert torch.cuda.current_device() == 0 and o.device == dev
    ref = _ref_attention(q, k, v, True)
    assert (o.double() - ref).abs().max() < 2e-2
    qr = q.detach().double().requires_grad_()
    from flashtune.reference import reference
    r = reference(qr, k.detach().double(), v.detach().double(), causal=True)
    ref_dq, = torch.autograd.grad(r.square().sum(), (qr,))
    assert (dq.double() - ref_dq).abs().max() < 5e-2 * ref_dq.abs().max()


def test_pdl_can_be_turned_off(monkeypatch):
    # FLASHTUNE_PDL=0: no programmatic dependent launch even where the GPU and Triton offer it
    # (a debugging escape hatch beside FLASHTUNE_SLOW_LAUNCH)
    from flashtune import launch
    monkeypatch.setattr(launch, "_pdl_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("FLASHTUNE_PDL", raising=False)
    assert launch.pdl_ok(cuda)
    monkeypatch.setenv("FLASHTUNE_PDL", "0")
    assert not launch.pdl_ok(cuda)
    monkeypatch.setenv("FLASHTUNE_PDL", "1")
    assert launch.pdl_ok(cuda)
    assert not launch.pdl_ok(torch.device("cpu"))


def _gluon_desc_parts():
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.language._layouts import NVMMASharedLayout
    layout = NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return gluon.TensorDescriptor, layout


def test_descriptor_copies_are_gluons_own_descriptor_and_hold_no_tensor():
    """Descriptors: a copy of the kept template with the call's tensor equals the descriptor
    Gluon builds (every field); the template keeps no tensor alive; another block shape or
    dtype is another template."""
    import dataclasses
    import gc
    import weakref
    TD, layout = _gluon_desc_parts()
    descs = L.Descriptors(TD)
    args = ([2, 64, 64], [4096, 64, 1], [1, 64, 64], layout)
    first = torch.randn(2, 64, 64, dtype=torch.float16)
    gone = weakref.ref(first)
    descs(first, *args)
    del first
    gc.collect()
    assert gone() is None, "the template holds the first call's tensor"
    t = torch.randn(2, 64, 64, dtype=torch.float16)
    d, own = descs(t, *args), TD(t, *args)
    assert type(d) is TD and d.base is t
    for f in dataclasses.fields(TD):
        assert f.name == "base" or getattr(d, f.name) == getattr(own, f.name), f.name
    assert len(descs.templates) == 1
    descs(t, [2, 64, 64], [4096, 64, 1], [1, 32, 64], layout)
    descs(t.float(), *args[:3], type(layout)(swizzle_byte_width=128, element_bitwidth=32, rank=3))
    assert len(descs.templates) == 3


def test_launcher_knows_descriptor_copies_and_checks_their_base(fake_cuda):
    """A Descriptors copy of the template the first launch saw stays direct; its base's
    alignment is still checked, and a copy of another template, or a plain descriptor that
    differs, takes Triton's path (a plain one equal to the captured key stays direct)."""
    TD, layout = _gluon_desc_parts()
    descs = L.Descriptors(TD)
    args = ([2, 64, 64], [4096, 64, 1], [1, 64, 64], layout)
    log = []
    lau = L.Launcher(_fake_jit(log))

    def tensor():
        return torch.randn(2, 64, 64, dtype=torch.float16)
    lau((1,), descs(tensor(), *args), 7)
    lau((1,), descs(tensor(), *args), 7)
    assert _paths(log) == ["triton", "direct"]
    template = next(iter(descs.templates.values()))
    misaligned = torch.randn(2 * 64 * 64 + 8, dtype=torch.float16)[1:1 + 2 * 64 * 64]
    assert misaligned.data_ptr() % 16
    copy = descs(tensor(), *args)
    copy.base = misaligned.view(2, 64, 64)  # as a template copy would carry it
    assert copy.ft_sig is template.ft_sig
    lau((1,), copy, 7)
    lau((1,), descs(tensor(), [2, 64, 64], [4096, 64, 1], [1, 32, 64], layout), 7)
    lau((1,), TD(tensor(), *args), 7)
    assert _paths(log) == ["triton", "direct", "triton", "triton", "direct"]
