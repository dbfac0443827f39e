"""Backward attention against the float64 reference's gradients (interpreter on the CPU, the GPU
when present): dQ, dK, dV within DESIGN.md's tolerance, both dQ schemes, masks, GQA, layouts,
bad input, and that nothing quadratic is saved."""
import pytest
import torch

import flashtune
from flashtune import ops
from flashtune.accuracy import compare
from flashtune.codegen import Variant
from flashtune.reference import reference, same_dtype_math

from _check import qkv

DTYPES = [torch.float16, torch.float32]
SHAPES = [(1, 1), (17, 17), (113, 203), (203, 113), (64, 64), (1, 130)]
# small tiles, so that the small shapes above still span several blocks of every loop
SCHEMES = {
    "atomic": "bwd-m16-n32-w4-s1-dq=atomic",
    "separate": "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1",
    "fused": "bwd-m16-n32-w4-s1-dq=fused-mq32-nq16",
}


def grads(q, k, v, causal=False, scale=None, do=None, **kw):
    """flashtune's (out, dq, dk, dv) for upstream gradient `do` (random when None)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flashtune.attention(q, k, v, causal=causal, scale=scale, **kw)
    if do is None:
        do = torch.randn_like(out)
    return (out, *torch.autograd.grad(out, (q, k, v), do)), do


def assert_grads_match(q, k, v, causal=False, scale=None, do=None, **kw):
    """do: the upstream gradient (random, laid out like the output, when None)."""
    (out, dq, dk, dv), do = grads(q, k, v, causal, scale, do, **kw)
    if k.shape[2] == 1:
        # one key: P = 1 and the exact dQ and dK are 0, which PyTorch's softmax backward hits
        # bit-exactly (dP - rowsum(P * dP) = 0), so DESIGN's tolerance is 0 there. FA2's
        # dP - Delta cancels to float32 noise instead: bound it absolutely, compare dV as usual.
        assert max(dq.abs().max(), dk.abs().max()) < 1e-4, (dq.abs().max(), dk.abs().max())
        dq = dk = None

    # the references take the call's window / softcap too (a block mask has its own helpers)
    assert set(kw) <= {"window", "softcap"}, f"assert_grads_match: no reference for {set(kw)}"

    def ref_grads(dtype, fn):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*xs, causal=causal, scale=scale, **kw), xs, do.to(dtype))

    ref = ref_grads(torch.float64, reference)
    base = ref_grads(q.dtype, same_dtype_math)  # PyTorch's own error sets the tolerance
    for name, g, x, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v), ref, base):
        if g is None:
            continue
        assert g.dtype == x.dtype and g.shape == x.shape, name
        report = compare(g, r, b)
        assert report.ok, f"{name}: {report}"
    return out, dq, dk, dv


@pytest.fixture(params=sorted(SCHEMES))
def scheme(request):
    with flashtune.force(SCHEMES[request.param]):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_shapes(nq, nk, causal, dtype, scheme, device):
    assert_grads_match(*qkv(2, 2, 2, nq, nk, 64, dtype, device), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_default_variant(causal, device):
    # the built-in default tiles (one block per loop at these sizes in the interpreter)
    assert_grads_match(*qkv(1, 2, 1, 150, 133, 64, torch.float16, device), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_long_awkward(causal, device):
    # 1023x1024 (tails on both sides, the diagonal off by one), many blocks of the default tiles
    assert_grads_match(*qkv(1, 1, 1, 1023, 1024, 32, torch.float16, device), causal=causal)


@pytest.mark.parametrize("d", [16, 48, 80, 96, 128, 160, 192, 256])
def test_head_dims(d, device):
    with flashtune.force(SCHEMES["atomic"] if d % 32 else SCHEMES["separate"]):
        assert_grads_match(*qkv(1, 2, 1, 37, 70, d, torch.float16, device), causal=True)


@pytest.mark.parametrize("h,hk", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(h, hk, causal, scheme, device):
    q, k, v = qkv(2, h, hk, 33, 47, 64, torch.float16, device)
    _, _, dk, dv = assert_grads_match(q, k, v, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape  # summed over each group, not expanded


def test_transposed_layout_keeps_strides(scheme, device):
    q, k, v = qkv(2, 3, 3, 45, 61, 64, torch.float16, device, layout="bnhd")
    _, dq, dk, dv = assert_grads_match(q, k, v, causal=True)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


def test_non_dense_strides(device):
    base = torch.randn(2, 4, 50, 96, dtype=torch.float16, device=device)
    q = base[:, ::2, :, :64]
    k = base[:, 1::2, 5:45, 32:]
    v = torch.randn(2, 2, 40, 64, dtype=torch.float16, device=device)
    assert_grads_match(q, k, v)


def test_custom_scale_float32(scheme, device):
    assert_grads_match(*qkv(1, 2, 2, 31, 29, 64, torch.float32, device), scale=0.3)


def test_rows_that_see_no_key_get_zero_gradients(scheme, device):
    # Nq > Nk, causal bottom-right: the first Nq - Nk rows see nothing (LSE = -inf)
    q, k, v = qkv(1, 2, 2, 40, 10, 32, torch.float16, device)
    _, dq, dk, dv = assert_grads_match(q, k, v, causal=True)
    assert torch.all(dq[:, :, :30] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("name", [
    "bwd-m16-n16-w4-s1-dq=atomic-causal_split=false",
    "bwd-m32-n16-w4-s2-dq=separate-mq16-nq32-wq4-sq2-causal_split=false",
    "bwd-m16-n64-w4-s1-dq=separate-mq64-nq16-wq2-sq1",
    "bwd-m32-n32-w4-s1-dq=atomic-loads=descriptor",  # Q/dO via TMA, dQ by reduce-add
])
@pytest.mark.parametrize("causal", [False, True])
def test_structural_variants(name, causal, device):
    q, k, v = qkv(1, 2, 1, 97, 75, 80, torch.float16, device)
    with flashtune.force(name) as variant:
        assert isinstance(variant, Variant)
        assert_grads_match(q, k, v, causal=causal)


def test_deterministic_forces_separate_dq(device):
    q, k, v = qkv(1, 4, 2, 70, 90, 64, torch.float16, device)
    with flashtune.force(SCHEMES["atomic"]):
        assert ops.select_bwd(q, k, True, deterministic=False).dq == "atomic"
        chosen = ops.select_bwd(q, k, True, deterministic=True)
        assert chosen.dq == "separate" and chosen.block_m2 and chosen.num_warps2
        # same dK/dV tiles as the atomic variant it replaces
        assert (chosen.block_m, chosen.block_n) == (16, 32)
        (_, *g1), do = grads(q, k, v, causal=True, deterministic=True)
        (_, *g2), _ = grads(q, k, v, causal=True, do=do, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))



def test_fused_dq_is_one_launch_and_deterministic(device):
    # dq="fused": the dQ programs ride in the dK/dV kernel's launch (no attn_bwd_dq launch)
    from flashtune import launch_bwd
    fused = Variant.parse(SCHEMES["fused"])
    params = launch_bwd.kernel_params(fused, torch.float16, 64, True, 2, 70, 90)
    assert set(params) == {"pre", "dkdv"}
    assert (params["dkdv"][0]["BLOCK_M2"], params["dkdv"][0]["BLOCK_N2"]) == (32, 16)
    q, k, v = qkv(1, 4, 2, 70, 90, 64, torch.float16, device)
    with flashtune.force(fused):
        assert ops.select_bwd(q, k, True, deterministic=True) == fused  # no atomics: kept
        (_, *g1), do = grads(q, k, v, causal=True, deterministic=True)
        (_, *g2), _ = grads(q, k, v, causal=True, do=do, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("name,match", [
    ("bwd-m16-n32-w4-s1-dq=fused", "block_m2 and block_n2"),
    ("bwd-m16-n32-w4-s1-dq=fused-mq32-nq16-wq4-sq1", "no num_warps2/num_stages2"),
])
def test_fused_dq_needs_its_tiles_and_no_launch_knobs(name, match, device):
    q, k, v = qkv(1, 2, 2, 20, 20, 32, torch.float16, device)
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=device)
    from flashtune import launch_bwd
    with pytest.raises(ValueError, match=match):
        launch_bwd.backward(o, q, k, v, o, lse, False, None, Variant.parse(name))

def test_forced_variant_reaches_a_backward_on_another_thread(device, monkeypatch):
    # autograd runs CUDA backwards on a thread of its own, where force()'s thread-local is unset
    import threading

    from flashtune import ops
    used = []  # the variant of each backward plan built
    real = ops._bwd_plan
    monkeypatch.setattr(ops, "_bwd_plan", lambda *a: used.append(a[5]) or real(*a))
    ops._bwd_plans.clear()
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 20, 20, 32, torch.float16, device))
    with flashtune.force(SCHEMES["separate"]) as forced:
        out = flashtune.attention(q, k, v)
    worker = threading.Thread(target=lambda: out.backward(torch.ones_like(out)))
    worker.start()
    worker.join()
    assert used == [forced] and q.grad is not None


def test_default_schemes_agree(device):
    q, k, v = qkv(1, 2, 2, 77, 77, 64, torch.float32, device)
    (_, *ga), do = grads(q, k, v, causal=True)
    (_, *gs), _ = grads(q, k, v, causal=True, do=do, deterministic=True)
    for a, s in zip(ga, gs):
        torch.testing.assert_close(a, s, atol=2e-5, rtol=1e-4)


def test_some_inputs_without_grad(device):
    q, k, v = qkv(1, 2, 2, 20, 30, 32, torch.float16, device)
    q.requires_grad_()
    out = flashtune.attention(q, k, v, causal=True)
    out.float().sum().backward()  # expanded (stride-0) upstream gradient
    assert q.grad is not None and k.grad is None and v.grad is None
    assert torch.isfinite(q.grad).all()


def test_non_contiguous_grad_output(device):
    q, k, v = qkv(1, 2, 2, 24, 24, 32, torch.float32, device)
    g = torch.randn(1, 2, 32, 24, device=device).transpose(-1, -2)  # head dim not contiguous
    (_, *a), _ = grads(q, k, v, do=g)
    (_, *b), _ = grads(q, k, v, do=g.contiguous())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_empty_inputs(device):
    for b, nq, nk in ((0, 8, 8), (1, 0, 8), (1, 5, 0)):
        q, k, v = (t.requires_grad_() for t in qkv(b, 2, 2, nq, nk, 32, torch.float16, device))
        out = flashtune.attention(q, k, v)
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            assert t.grad.shape == t.shape and torch.all(t.grad == 0)


# -- bad input (item 5): clear errors naming the argument --------------------------------------

def test_grad_output_of_wrong_shape(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 8, 8, 32, torch.float16, device))
    out = flashtune.attention(q, k, v)
    with pytest.raises(RuntimeError, match="shape"):
        out.backward(torch.ones(1, 2, 8, 16, dtype=out.dtype, device=device))


@pytest.mark.parametrize("bad", ["shape", "dtype", "type"])
def test_backward_op_checks_grad_output(bad, device):
    q, k, v = qkv(1, 2, 2, 8, 8, 32, torch.float16, device)
    o, lse = ops.run_forward(q, k, v, False, None)
    g = {"shape": torch.ones(1, 2, 9, 32, dtype=o.dtype, device=device),
         "dtype": torch.ones_like(o, dtype=torch.float32),
         "type": None}[bad]
    with pytest.raises((ValueError, TypeError, RuntimeError), match="grad_output"):
        torch.ops.flashtune.attn_bwd(g, q, k, v, o, lse, False, None, False)


def test_backward_without_requires_grad(device):
    q, k, v = qkv(1, 2, 2, 8, 8, 32, torch.float16, device)
    out = flashtune.attention(q, k, v)
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.backward(torch.ones_like(out))


def test_deterministic_must_be_bool(device):
    q, k, v = qkv(1, 2, 2, 8, 8, 32, torch.float16, device)
    with pytest.raises(TypeError, match="deterministic"):
        flashtune.attention(q, k, v, deterministic=1)


# -- memory (item 3): only q, k, v, O and the float32 LSE are saved ---------------------------

def test_saves_nothing_quadratic(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 300, 257, 32, torch.float16, device))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        flashtune.attention(q, k, v, causal=True)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(1, 2, 300, 32), (1, 1, 257, 32), (1, 1, 257, 32),
                             (1, 2, 300, 32), (1, 2, 300)]), shapes
    assert [t.dtype for t in saved if t.dim() == 3] == [torch.float32]


def test_opcheck(device):
    q, k, v = qkv(1, 2, 1, 19, 23, 32, torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashtune.attn_fwd.default, (q, k, v, True, None, False))
    o, lse = ops.run_forward(q.detach(), k.detach(), v.detach(), True, None)
    torch.library.opcheck(torch.ops.flashtune.attn_bwd.default,
                          (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse,
                           True, None, False))


# -- GPU: bfloat16, long sequences, both schemes, CUDA graphs ---------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dq", ["atomic", "separate"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long(dtype, d, causal, dq, device):
    from flashtune.defaults import default_variant
    v = default_variant("bwd", d, str(dtype).removeprefix("torch."), dq=dq)
    with flashtune.force(v):
        assert_grads_match(*qkv(1, 4, 2, 4096, 4096, d, dtype, device), causal=causal)
        assert_grads_match(*qkv(2, 2, 1, 1000, 3001, d, dtype, device, layout="bnhd"),
                           causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 96, 256])
def test_gpu_head_dims_bf16(d, device):
    assert_grads_match(*qkv(2, 4, 1, 777, 1025, d, torch.bfloat16, device), causal=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(device):
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, 512, 512, 64, torch.bfloat16, device))
    do = torch.randn(2, 4, 512, 64, dtype=torch.bfloat16, device=device)

    def step():
        out = flashtune.attention(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), do)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager = step()  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.normal_()
    graph.replay()
    expected = step()
    torch.cuda.synchronize()
    for a, b, e in zip(static, expected, eager):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert not torch.equal(a, e)  # the replay saw the new inputs


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False, window=(5, 3), softcap=2.0)])
def test_eager_autograd_equals_the_registered_op(kw, device):
    # eager calls with gradients skip torch.library's dispatch (ops.eager_autograd) but must be
    # the op's formula exactly: same outputs, same gradients, same saved LSE
    q, k, v = qkv(2, 4, 2, 19, 23, 16, torch.float16, device)
    g = torch.randn(2, 4, 19, 16, dtype=torch.float16, device=device)
    wl, wr = kw.get("window", (-1, -1))
    results = []
    for path in ("eager", "op"):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if path == "eager":
            out, lse = flashtune.attention(*xs, return_lse=True, **kw)
        else:
            out, lse = ops.attn_fwd(*xs, kw["causal"], None, False, wl, wr, kw.get("softcap"))
        results.append((out, lse, *torch.autograd.grad(out, xs, g)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert type(results[0][0].grad_fn).__name__ != type(results[1][0].grad_fn).__name__


