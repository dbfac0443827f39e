"""attention_varlen: packed variable-length sequences against the float64 reference run per
sequence (forward, dQ, dK, dV within DESIGN.md's tolerance), empty and one-token sequences,
Nq != Nk, causal, GQA/MQA, awkward head dims, both dQ schemes, return_lse, torch.compile, bad
input, and that non-varlen kernels are untouched by the varlen template code."""
import dataclasses
import math

import pytest
import torch

import flashtune
from flashtune.accuracy import compare
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.reference import reference, same_dtype_math

BWD = {
    "atomic": "bwd-m16-n32-w4-s1-dq=atomic",
    "separate": "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1",
    "fused": "bwd-m16-n32-w4-s1-dq=fused-mq32-nq16",
    # Q/dO through descriptors spanning each sequence's rows (dQ by a reduce-add)
    "atomic_desc": "bwd-m16-n32-w4-s1-loads=descriptor-dq=atomic",
}
# lengths with an empty sequence on each side, one-token sequences, Nq != Nk, Nq > Nk (causal
# rows that see nothing) and several 16/32-row blocks in the longest
LENS_Q = [21, 0, 1, 37, 5, 9]
LENS_K = [13, 6, 1, 40, 0, 30]


def cu(lens, device):
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def packed(lens_q, lens_k, h, hk, d, dtype, device):
    """Fresh random packed q (total_q, h, d), k, v (total_k, hk, d) and their cu_seqlens."""
    q = torch.randn(sum(lens_q), h, d, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device)
    return q, k, v, cu(lens_q, device), cu(lens_k, device)


def _per_sequence(fn, q, k, v, cu_q, cu_k, causal, scale, do, dtype):
    """fn (reference or same_dtype_math) run on each sequence as a (1, H, N, D) problem, results
    packed back: (out, dq, dk, dv) in `dtype`."""
    outs, grads = [], ([], [], [])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        xs = [t[s].detach().to(dtype).transpose(0, 1)[None].requires_grad_()
              for t, s in ((q, qs), (k, ks), (v, ks))]
        if ks.stop == ks.start:  # no key: zeros, zero gradients (flashtune's documented rows)
            o = torch.zeros_like(xs[0])
            gs = [torch.zeros_like(x) for x in xs]
        else:
            o = fn(*xs, causal=causal, scale=scale)
            gs = torch.autograd.grad(o, xs, do[qs].to(dtype).transpose(0, 1)[None],
                                     allow_unused=True) if qs.stop > qs.start else \
                [torch.zeros_like(x) for x in xs]
        outs.append(o[0].transpose(0, 1))
        for acc, g in zip(grads, gs):
            acc.append(g[0].transpose(0, 1))
    return (torch.cat(outs), *(torch.cat(g) for g in grads))


def assert_varlen_matches(q, k, v, cu_q, cu_k, causal=False, scale=None, grads=True, **kw):
    lq = (cu_q[1:] - cu_q[:-1]).tolist()
    lk = (cu_k[1:] - cu_k[:-1]).tolist()
    xs = [t.detach().requires_grad_(grads) for t in (q, k, v)]
    out = flashtune.attention_varlen(*xs, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                     scale=scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    do = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, xs, do)) if grads else (out,)
    ref = _per_sequence(reference, q, k, v, cu_q, cu_k, causal, scale, do, torch.float64)
    base = _per_sequence(same_dtype_math, q, k, v, cu_q, cu_k, causal, scale, do, q.dtype)
    for name, g, x, r, b in zip(("out", "dq", "dk", "dv"), got, (q, k, v, v), ref, base):
        assert g.dtype == x.dtype and g.shape == r.shape, name
        report = compare(g, r, b)
        assert report.ok, f"{name}: {report}"
    return got


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scheme", sorted(BWD))
def test_forward_and_gradients(scheme, causal, dtype, device):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, 4, 2, 32, dtype, device)
    with flashtune.force(BWD[scheme]):  # the forced bwd variant runs as its varlen twin
        _, dq, dk, dv = assert_varlen_matches(q, k, v, cu_q, cu_k, causal=causal)
    # the empty-query sequence (index 1) still gets dK = dV = 0 written for its 6 keys
    k1 = slice(LENS_K[0], LENS_K[0] + LENS_K[1])
    assert torch.all(dk[k1] == 0) and torch.all(dv[k1] == 0)
    # the empty-key sequence (index 4): its queries get zero gradients
    q4 = slice(sum(LENS_Q[:4]), sum(LENS_Q[:5]))
    assert torch.all(dq[q4] == 0)


@pytest.mark.parametrize("fwd", ["fwd-m16-n16-w4-s1", "fwd-m32-n16-w4-s1-causal_split=false",
                                 "fwd-m16-n32-w4-s1-loads=descriptor"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_small_tiles(fwd, causal, device):
    # several query and key blocks per sequence; blocks past a short sequence's end exit
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, 2, 1, 32, torch.float16, device)
    with flashtune.force(fwd):
        assert_varlen_matches(q, k, v, cu_q, cu_k, causal=causal, grads=False)


@pytest.mark.parametrize("h,hk,d", [(4, 1, 80), (2, 2, 48)])
def test_mqa_and_awkward_head_dims(h, hk, d, device):
    q, k, v, cu_q, cu_k = packed([7, 19, 0], [23, 4, 2], h, hk, d, torch.float16, device)
    with flashtune.force(BWD["atomic"]):
        assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True, scale=0.3)


def test_bfloat16(device):
    q, k, v, cu_q, cu_k = packed([9, 0, 26], [17, 5, 20], 4, 2, 32, torch.bfloat16, device)
    with flashtune.force(BWD["separate"]):
        assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True)


def test_decode_shaped_call_keeps_its_own_family(device):
    # one query per sequence, GQA: the shape the dispatcher hands dense forwards to split-KV,
    # which has no varlen kernels: a varlen call must get the fwd family's variant, made varlen
    q, k, v, cu_q, cu_k = packed([1, 1, 1], [40, 7, 90], 8, 2, 32, torch.float16, device)
    assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True, grads=False)


def test_default_variants_and_deterministic(device):
    # the dispatcher's (built-in default) fwd and bwd variants, made varlen
    q, k, v, cu_q, cu_k = packed([5, 33], [40, 2], 2, 1, 32, torch.float16, device)
    assert_varlen_matches(q, k, v, cu_q, cu_k, causal=False, deterministic=True)


def test_equal_lengths_equal_dense_attention(device):
    # B sequences of one length, packed: the same numbers as attention() on the (B, N, H, D) view
    b, n, h, d = 3, 20, 2, 32
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float16, device=device) for _ in range(3))
    dense = flashtune.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    c = cu([n] * b, device)
    out = flashtune.attention_varlen(*(t.reshape(b * n, h, d) for t in (q, k, v)), c, c, n, n,
                                     causal=True)
    torch.testing.assert_close(out, dense.transpose(1, 2).reshape(b * n, h, d), atol=2e-3, rtol=0)


def test_descriptor_forward_falls_back_for_unaligned_tensors(device, monkeypatch):
    # a TMA variant forced on tensors whose base is not 16-byte aligned (sliced 1 element in):
    # the portable pointer default runs instead, with the same numbers
    from flashtune import dispatch, launch
    seen = []
    real = launch.VarlenFwdPlan.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        seen.append(self.variant)
    monkeypatch.setattr(launch.VarlenFwdPlan, "__init__", spy)
    buf = torch.randn(3, 29, 2, 33, dtype=torch.float16, device=device)
    q, k, v = (t[..., 1:] for t in buf.unbind(0))
    c = cu([12, 17], device)
    with flashtune.force("fwd-m16-n32-w4-s1-loads=descriptor"):
        assert_varlen_matches(q, k, v, c, c, causal=True, grads=False)
    assert seen and seen[-1] == dispatch.varlen_pointer_fallback("fwd", 32, "float16")
    assert seen[-1].loads == "pointer"


def test_offsets_checked_once_per_tensor_version(device, monkeypatch):
    # the layers of a step share cu_seqlens: one host check, until the offsets change in place
    from flashtune import ops_varlen
    calls = []
    real = ops_varlen.check_cu_seqlens_values
    monkeypatch.setattr(ops_varlen, "check_cu_seqlens_values",
                        lambda *a: (calls.append(1), real(*a))[1])
    q, k, v, cu_q, cu_k = packed([5, 9], [7, 12], 2, 1, 16, torch.float16, device)
    for _ in range(3):
        flashtune.attention_varlen(q, k, v, cu_q, cu_k, 9, 12)
    assert len(calls) == 1
    flashtune.attention_varlen(q, k, v, cu_q, cu_k, 10, 12)  # other bounds: checked again
    assert len(calls) == 2
    cu_k[1] += 30  # an in-place write bumps the version: checked again, and refused
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        flashtune.attention_varlen(q, k, v, cu_q, cu_k, 9, 12)


def test_offsets_rewritten_behind_pytorchs_back_stay_in_bounds(device):
    # a write PyTorch cannot see (through .data: no version bump) skips the host check; the
    # kernels clamp each sequence to the packed tensors and max_seqlen, so nothing is read or
    # written out of bounds (the answer is for the clamped sequences)
    q, k, v, cu_q, cu_k = packed([5, 9], [7, 12], 2, 1, 16, torch.float16, device)
    flashtune.attention_varlen(q, k, v, cu_q, cu_k, 9, 12)
    cu_q.data[1], cu_k.data[2] = -50, 10_000
    out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, 9, 12)
    # sequence 0 is now empty (zeros); sequence 1 spans q rows 0..8 (max_seqlen_q) and k rows 7..18
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:9].transpose(0, 1).float(), k[7:].transpose(0, 1).float().expand(2, -1, -1),
        v[7:].transpose(0, 1).float().expand(2, -1, -1))
    torch.testing.assert_close(out[:9].float(), ref.transpose(0, 1), atol=2e-3, rtol=2e-3)


def test_strided_packed_qkv(device):
    # q, k, v sliced out of one (total, 3, H, D) projection: token stride 3*H*D, no copy
    qkv = torch.randn(30, 3, 2, 32, dtype=torch.float16, device=device)
    q, k, v = qkv.unbind(1)
    c = cu([12, 18], device)
    assert_varlen_matches(q, k, v, c, c, causal=True, grads=False)


def test_return_lse(device):
    lens_q, lens_k = [6, 0, 20, 3], [4, 5, 9, 0]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, 32, torch.float16, device)
    o, lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, 20, 9, causal=True, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (4, sum(lens_q))
    assert torch.equal(o, flashtune.attention_varlen(q, k, v, cu_q, cu_k, 20, 9, causal=True))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        if not lens_q[b]:
            continue
        qb = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(2, dim=0)
        s = qb @ kb.transpose(-1, -2) / math.sqrt(32)
        nq, nk = lens_q[b], lens_k[b]
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq),
                          float("-inf"))
        ref = (torch.logsumexp(s, dim=-1) if nk
               else torch.full((4, nq), float("-inf"), dtype=torch.float64, device=device))
        got = lse[:, cq[b]:cq[b + 1]].double()
        empty = torch.isinf(ref)
        assert torch.equal(torch.isinf(got), empty)  # -inf exactly where no key is seen
        if (~empty).any():
            assert (got - ref)[~empty].abs().max().item() < 2e-3 * max(1.0, ref[~empty].abs().max())


def test_torch_compile_aot_eager(device):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed([7, 0, 12], [9, 4, 12], 4, 2, 32, torch.float32, device)

    def f(q, k, v):
        o, lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, 12, 12, causal=True,
                                            return_lse=True)
        return (o * 2).sum() + lse[lse.isfinite()].sum()

    def run(fn):
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        y = fn(*xs)
        return (y.detach(), *torch.autograd.grad(y, xs))

    want = run(f)
    got = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# -- bad input ------------------------------------------------------------------------------------
def _good(device):
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 4], 4, 2, 32, torch.float16, device)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                max_seqlen_k=4)


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)  # moved to the test's device in test_bad_input


@pytest.mark.parametrize("over,exc,words", [
    (dict(q=torch.randn(8, 4, 32).half()[None]), ValueError,
     ["q must have 3 dims (total_tokens, heads, head_dim)"]),
    (dict(k=[1]), TypeError, ["k must be a torch.Tensor"]),
    (dict(v=torch.randn(8, 2, 32)), TypeError, ["v.dtype", "must match q.dtype"]),
    (dict(k=torch.randn(8, 3, 32).half(), v=torch.randn(8, 3, 32).half()), ValueError,
     ["q heads (4)", "multiple of k/v heads (3)"]),
    (dict(k=torch.randn(8, 2, 64).half(), v=torch.randn(8, 2, 64).half()), ValueError,
     ["head_dim differs"]),
    (dict(q=torch.randn(8, 4, 8).half(), k=torch.randn(8, 2, 8).half(),
          v=torch.randn(8, 2, 8).half()), ValueError, ["head_dim 8", "16..256"]),
    (dict(v=torch.randn(9, 2, 32).half()), ValueError, ["k and v must have the same shape"]),
    (dict(q=torch.randn(8, 32, 4).half().transpose(1, 2)), ValueError,
     ["q must have a contiguous last dim"]),
    (dict(cu_seqlens_q=[0, 3, 8]), TypeError, ["cu_seqlens_q must be a torch.Tensor"]),
    (dict(cu_seqlens_k=_i32(0, 4, 8)[None]), ValueError, ["cu_seqlens_k must be 1-D"]),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), TypeError,
     ["cu_seqlens_q.dtype must be torch.int32", "int64"]),
    (dict(cu_seqlens_k=_i32(0, 8)), ValueError,
     ["cu_seqlens_q has 3 entries but cu_seqlens_k has 2"]),
    (dict(max_seqlen_q=5.0), TypeError, ["max_seqlen_q must be an int"]),
    (dict(max_seqlen_k=-1), ValueError, ["max_seqlen_k must be >= 0"]),
    (dict(causal="yes"), TypeError, ["causal must be a bool"]),
    (dict(scale=0.0), ValueError, ["scale must be a finite positive number"]),
    (dict(return_lse=1), TypeError, ["return_lse must be a bool"]),
    # the offsets' values, checked before any launch
    (dict(cu_seqlens_q=_i32(1, 3, 8)), ValueError, ["cu_seqlens_q must start at 0, got 1"]),
    (dict(cu_seqlens_k=_i32(0, 6, 3)), ValueError, ["cu_seqlens_k must be non-decreasing", "entry 2 (3) < entry 1 (6)"]),
    (dict(cu_seqlens_q=_i32(0, 3, 7)), ValueError,
     ["cu_seqlens_q[-1] is 7 but q hold 8 tokens"]),
    (dict(cu_seqlens_k=_i32(0, 4, 9)), ValueError,
     ["cu_seqlens_k[-1] is 9 but k and v hold 8 tokens"]),
    (dict(max_seqlen_q=4), ValueError,
     ["max_seqlen_q is 4 but sequence 1 of cu_seqlens_q has 5 tokens"]),
    (dict(max_seqlen_k=3), ValueError, ["max_seqlen_k is 3", "has 4 tokens"]),
])
def test_bad_input(over, exc, words, monkeypatch, device):
    over = {k: x.to(device) if isinstance(x, torch.Tensor) else x for k, x in over.items()}
    args = {**_good(device), **over}
    kw = {k: args.pop(k) for k in ("causal", "scale", "return_lse") if k in args}
    launched = []
    from flashtune import launch
    monkeypatch.setattr(launch, "forward_varlen", lambda *a, **k: launched.append(a))
    for grad in (False, True):  # the inference path and the op's
        a = dict(args)
        if grad and isinstance(a["q"], torch.Tensor) and a["q"].is_floating_point():
            a["q"] = a["q"].detach().requires_grad_()
        with pytest.raises(exc) as e:
            flashtune.attention_varlen(*a.values(), **kw)
        for w in words:
            assert w in str(e.value), str(e.value)
    assert not launched


@pytest.mark.gpu
def test_offsets_on_another_device():
    g = _good("cpu")
    with pytest.raises(ValueError, match="cu_seqlens_q is on cpu but q is on cuda"):
        flashtune.attention_varlen(g["q"].cuda(), g["k"].cuda(), g["v"].cuda(), g["cu_seqlens_q"],
                                   g["cu_seqlens_k"].cuda(), 5, 4)


def test_offsets_on_another_device_meta(device):
    # a meta cu_seqlens is "another device" on any machine
    g = _good(device)
    g["cu_seqlens_k"] = g["cu_seqlens_k"].to("meta")
    with pytest.raises(ValueError, match=f"cu_seqlens_k is on meta but q is on {device}"):
        flashtune.attention_varlen(*g.values())


# -- the template: non-varlen kernels untouched ---------------------------------------------------
@pytest.mark.parametrize("name", ["fwd-m128-n64-w4-s2-loads=descriptor", "fwd-m128-n64-w8-s4",
                                  "fwd-m64-n32-w4-s2-causal_split=false",
                                  "bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2",
                                  "bwd-m32-n128-w8-s3-dq=atomic",
                                  "bwd-m16-n32-w4-s1-dq=atomic-causal_split=false"])
def test_varlen_code_only_in_varlen_renders(name):
    v = Variant.parse(name)
    vl = dataclasses.replace(v, varlen=True, loads="pointer")
    assert v.key != vl.key and kernel_hash(v) != kernel_hash(vl)
    for interpret in (False, True):
        dense, packed_src = render(v, interpret), render(vl, interpret)
        code = [ln for ln in dense.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
        for word in ("cu_seqlens", "varlen", "max_seqlen", "total_q", "q_start", "k_start"):
            assert not any(word in ln.lower() for ln in code), (word, interpret)
        assert "CU_SEQLENS_Q" in packed_src and "make_tensor_descriptor" not in packed_src
        assert len(dense.splitlines()) == len(packed_src.splitlines())  # line numbers match


@pytest.mark.slow
def test_varlen_renders_compile_for_sm90():
    # the GPU (non-interpreter) render of each kernel, compiled for Hopper without a GPU, in a
    # process of its own (this one imported Triton in interpreter mode); ~25 s with a cold cache
    import json
    import os
    import subprocess
    import sys
    code = ("import dataclasses, json\n"
            "from flashtune.codegen import Variant\n"
            "from flashtune.compile_check import check_variant\n"
            "out = {}\n"
            "for n in ('fwd-m128-n64-w8-s2', 'fwd-m64-n32-w4-s2-causal_split=false',\n"
            "          'fwd-m128-n64-w4-s2-loads=descriptor',\n"
            "          'bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2',\n"
            "          'bwd-m32-n128-w8-s3-dq=atomic'):\n"
            "    v = dataclasses.replace(Variant.parse(n), varlen=True)\n"
            "    out[v.name] = check_variant(v, 128, 'bfloat16', tails=True, usage=False)\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res) == 5 and all(0 < k["smem"] <= 232448 for v in res.values() for k in v.values())
    assert set(res["bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2-varlen=true"]) == \
        {"pre", "dkdv", "dq"}
