"""flashtune.force: a call pins until force(None), a `with` block pins for the block, a bad name
fails at once."""
import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.codegen import Variant

from _check import assert_matches_reference, qkv

NAME = "fwd-m32-n16-w4-s1"


@pytest.fixture(autouse=True)
def _unpin():
    yield
    flashtune.force(None)


def test_call_pins_until_undone():
    pinned = flashtune.force(NAME)
    assert pinned.variant == Variant.parse(NAME) == dispatch.forced_variant()
    assert dispatch.forced_variant() == Variant.parse(NAME)  # still pinned after the call
    flashtune.force(None)
    assert dispatch.forced_variant() is None


def test_with_pins_for_the_block_and_restores():
    flashtune.force(NAME)
    with flashtune.force("fwd-m64-n32-w4-s2") as v:
        assert v.name == "fwd-m64-n32-w4-s2" == dispatch.forced_variant().name
    assert dispatch.forced_variant().name == NAME
    flashtune.force(None)
    with flashtune.force(NAME):
        pass
    assert dispatch.forced_variant() is None


def test_pinned_variant_runs(device, monkeypatch):
    used = []
    real = dispatch.select_for_call
    monkeypatch.setattr(dispatch, "select_for_call",
                        lambda *a: used.append(r := real(*a)) or r)
    flashtune.force(NAME)
    q, k, v = qkv(1, 2, 1, 40, 50, 32, torch.float16, device)
    assert_matches_reference(q, k, v, causal=True)
    assert used and all(u.name == NAME for u in used)


def test_a_bwd_variant_forced_around_the_backward_runs(device, monkeypatch):
    # the fwd variant forced around the forward is carried to the backward (autograd's CUDA
    # thread does not see force()), but a variant forced where the backward runs wins
    from flashtune import launch_bwd, ops
    bwd = "bwd-m16-n32-w4-s1-dq=atomic"
    ran = []  # the variant of each backward plan built (a plan is kept per call signature)
    real = launch_bwd.plan
    monkeypatch.setattr(launch_bwd, "plan", lambda *a, **kw: ran.append(a[4]) or real(*a, **kw))
    ops._bwd_plans.clear()
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 40, 50, 32, torch.float16, device))
    with flashtune.force(NAME):
        out = flashtune.attention(q, k, v, causal=True)
    with flashtune.force(bwd):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert [r.name for r in ran] == [bwd]
    with flashtune.force(NAME):  # nothing forced around the backward: dispatched (not NAME)
        out = flashtune.attention(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert ran[-1].family == "bwd" and ran[-1].name != bwd


def test_a_forced_variant_keeps_its_plan(device, monkeypatch):
    """A forced variant's plan is built once per call signature, as a dispatched one's: built
    on every call, its host time was timed with the kernel wherever a bench forced a variant.
    Another forced variant, or none, is another plan; each call's answer is its own."""
    from flashtune import ops
    built = []
    real = ops._plan
    monkeypatch.setattr(ops, "_plan", lambda *a, **kw: built.append(a[5].name) or real(*a, **kw))
    ops._plans.clear()
    q, k, v = qkv(1, 2, 1, 40, 50, 32, torch.float16, device)
    other = "fwd-m64-n32-w4-s2"
    for name in (NAME, NAME, other, NAME, other):
        with flashtune.force(name):
            assert_matches_reference(q, k, v, causal=True)
    assert built == [NAME, other]
    assert_matches_reference(q, k, v, causal=True)  # dispatched: a plan of its own
    assert len(built) == 3 and len(ops._plans) == 3


@pytest.mark.parametrize("bad,exc,words", [
    ("garbage", ValueError, ["garbage"]),
    ("fwd-m128-n64-w8", ValueError, ["lacks", "num_stages"]),
    ("fwd-m100-n64-w8-s3", ValueError, ["block_m", "power of two"]),
    ("fwd-m128-n64-w8-s3-loads=tma", ValueError, ["loads"]),
    (42, TypeError, ["force()", "int"]),
])
def test_bad_name_fails_at_once(bad, exc, words):
    with pytest.raises(exc) as e:
        flashtune.force(bad)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert dispatch.forced_variant() is None  # nothing was pinned
