"""The bwd family's descriptor render (loads="descriptor"): Q and dO read through tensor
descriptors, dQ added by a TMA reduce-add (dq="atomic"), against the float64 reference's
gradients; tails, padded head dims, GQA, masks, and inputs TMA cannot address (the plan runs its
pointer twin). On the CPU the interpreter's read-add-write stands in for the reduce-add (the
template's header); the GPU tests run the real one."""
import pytest
import torch

import flashtune
from flashtune import launch_bwd
from flashtune.codegen import Variant
from flashtune.codegen.render import render

from _check import qkv
from test_backward import assert_grads_match

SCHEMES = {
    "atomic": "bwd-m16-n32-w4-s1-loads=descriptor-dq=atomic",
    "separate": "bwd-m16-n32-w4-s1-loads=descriptor-dq=separate-mq32-nq16-wq4-sq1",
    "fused": "bwd-m16-n32-w4-s1-loads=descriptor-dq=fused-mq32-nq16",
    # dq_loads: the dQ programs read K and V through descriptors too (alone, and with `loads`)
    "separate_kv": "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1-dq_loads=descriptor",
    "fused_kv": "bwd-m16-n32-w4-s1-loads=descriptor-dq=fused-mq32-nq16-dq_loads=descriptor",
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_descriptor_schemes_match_reference(scheme, causal, dtype, device):
    # 41 / 70 rows: tails on both sides; D=40 pads to 64; GQA 4:2
    with flashtune.force(SCHEMES[scheme]):
        assert_grads_match(*qkv(1, 4, 2, 41, 70, 40, dtype, device), causal=causal)


@pytest.mark.parametrize("kw", [{"window": (9, 3)}, {"softcap": 5.0}])
@pytest.mark.parametrize("scheme", ["atomic", "fused_kv"])
def test_descriptor_schemes_with_masks(scheme, kw, device):
    with flashtune.force(SCHEMES[scheme]):
        assert_grads_match(*qkv(2, 2, 1, 50, 37, 32, torch.float16, device), causal=True, **kw)


def test_descriptor_layout_bnhd(device):
    with flashtune.force(SCHEMES["atomic"]):
        assert_grads_match(*qkv(2, 2, 2, 33, 33, 32, torch.float16, device, layout="bnhd"))


# (scheme, the input 2 bytes off, its pointer twin): loads="descriptor" checks Q and dO per call,
# dq_loads="descriptor" K and V; the twin has pointer loads everywhere
UNALIGNED = {"q": ("atomic", "bwd-m16-n32-w4-s1-dq=atomic"),
             "k": ("separate_kv", "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1")}


@pytest.mark.parametrize("which", sorted(UNALIGNED))
def test_unaligned_inputs_run_the_pointer_twin(which, device):
    """An input whose base TMA cannot address gets the pointer twin's plan, built on the first
    such call and kept; the gradients are right either way."""
    scheme, twin = UNALIGNED[which]
    b, h, n, d = 1, 2, 40, 32
    raw = torch.randn(b * h * n * d + 1, dtype=torch.float16, device=device)
    q, k, v = qkv(b, h, h, n, n, d, torch.float16, device)
    if which == "q":
        q = raw[1:].view(b, h, n, d)
    else:
        k = raw[1:].view(b, h, n, d)
    variant = Variant.parse(SCHEMES[scheme])
    o, lse = flashtune.ops.run_forward(q, k, v, False, None)
    do = torch.randn_like(o)
    plan = launch_bwd.plan(q, k, False, None, variant)
    assert plan.descriptor and not isinstance(plan.twin, launch_bwd.BwdPlan)
    got = plan.run(do, q, k, v, o, lse)
    assert isinstance(plan.twin, launch_bwd.BwdPlan)
    assert plan.twin.variant == Variant.parse(twin)
    want = launch_bwd.backward(do, q.clone(), k.clone(), v, o, lse, False, None,
                               Variant.parse(twin))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=1e-3)


def test_dq_loads_renders_only_into_the_dq_programs():
    src = render(Variant.parse(SCHEMES["separate_kv"]))
    assert "k = k_base.load([start_n, 0])" in src and "q_base.load(" not in src
    plain = render(Variant.parse("bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1"))
    assert "make_tensor_descriptor" not in plain


def test_descriptor_render_reads_q_and_do_through_descriptors():
    src = render(Variant.parse("bwd-m64-n64-w4-s2-loads=descriptor-dq=atomic"))
    assert "q_base.load([start_m, 0])" in src and "dq_base.atomic_add([start_m, 0], dq)" in src
    assert "tl.atomic_add(" not in src
    pointer = render(Variant.parse("bwd-m64-n64-w4-s2-dq=atomic"))
    assert "make_tensor_descriptor" not in pointer and "tl.atomic_add(" in pointer


# -- GPU: bfloat16 and the real TMA reduce-add --------------------------------------------------

GPU_VARIANTS = {
    64: "bwd-m64-n128-w8-s2-loads=descriptor-dq=atomic",
    128: "bwd-m64-n128-w8-s2-loads=descriptor-dq=atomic",
    256: "bwd-m32-n32-w4-s2-loads=descriptor-dq=atomic",  # spills 68 B (sm_90): right, not fast
}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", sorted(GPU_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_descriptor_atomic(dtype, d, causal, device):
    with flashtune.force(GPU_VARIANTS[d]):
        assert_grads_match(*qkv(2, 4, 2, 1000, 1537, d, dtype, device, layout="bnhd"),
                           causal=causal)
        assert_grads_match(*qkv(1, 4, 4, 4096, 4096, d, dtype, device), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [
    "bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64",
    "bwd-m64-n128-w8-s2-loads=descriptor-dq=separate-mq128-nq64-wq8-sq2",
    "bwd-m64-n64-w4-s3-loads=descriptor-dq=atomic",
    "bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64-dq_loads=descriptor",
    "bwd-m64-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2-dq_loads=descriptor",
])
def test_gpu_descriptor_variants(name, device):
    with flashtune.force(name):
        assert_grads_match(*qkv(2, 8, 2, 777, 1025, 128, torch.bfloat16, device), causal=True)
        assert_grads_match(*qkv(1, 4, 4, 2048, 2048, 96, torch.bfloat16, device),
                           window=(255, 0), softcap=30.0)


def test_the_allocator_is_set_in_every_thread_that_launches():
    """Triton's allocator lives in a ContextVar: a backward on autograd's own thread must set it
    there too (a set once per process left that thread with none)."""
    import threading

    from triton.runtime import _allocation

    from flashtune import launch
    launch._need_allocator()
    seen = []
    t = threading.Thread(target=lambda: (launch._need_allocator(),
                                         seen.append(_allocation._allocator.get())))
    t.start()
    t.join()
    assert seen == [launch._alloc]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_descriptor_varlen(causal, device):
    # per-sequence descriptors (their rows only; a sequence with no query makes a 1-row one)
    from test_varlen import assert_varlen_matches, packed
    lens_q, lens_k = [700, 0, 1, 1537, 64], [900, 300, 1, 1537, 0]
    with flashtune.force(GPU_VARIANTS[128]):
        assert_varlen_matches(*packed(lens_q, lens_k, 4, 2, 128, torch.bfloat16, device),
                              causal=causal)
