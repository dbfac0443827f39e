"""launch_graphs.LaunchGraphs: plain launches for a key's first call, a graph captured on its
second and replayed from then on; plain launches while the stream is being captured, after a
failed capture, and with FLASHTUNE_SLOW_LAUNCH=1 (CPU: a stand-in graph records replays; GPU:
the hopper_bwd plan's gradients by graph equal its plain launches', bit for bit)."""
from __future__ import annotations

import pytest
import torch

from flashtune import launch_graphs as LG


class _Graph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


@pytest.fixture
def fake(monkeypatch):
    log = []
    state = {"capturing": False, "fail": False}

    def capture(launch):
        if state["fail"]:
            return None
        log.append("capture")
        return _Graph(log)
    monkeypatch.setattr(LG.LaunchGraphs, "_capture", staticmethod(capture))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(LG, "_current_device", lambda: state.get("current", 0))
    monkeypatch.delenv("FLASHTUNE_SLOW_LAUNCH", raising=False)
    return log, state


def test_second_call_captures_and_later_ones_replay(fake):
    log, _ = fake
    g = LG.LaunchGraphs()
    launch = lambda: log.append("launch")  # noqa: E731
    for key in ((1, 2), (1, 2), (1, 2), (3, 4), (1, 2), (3, 4), (3, 4)):
        g.run(key, launch, 0)
    assert log == ["launch", "capture", "replay", "replay", "launch", "replay", "capture",
                   "replay", "replay"]


def test_plain_launches_under_capture_after_failure_and_when_turned_off(fake, monkeypatch):
    log, state = fake
    launch = lambda: log.append("launch")  # noqa: E731
    g = LG.LaunchGraphs()
    state["capturing"] = True  # the caller's own graph records the launches themselves
    for _ in range(3):
        g.run((1,), launch, 0)
    assert log == ["launch"] * 3
    state["capturing"], state["fail"] = False, True
    log.clear()
    for _ in range(3):
        g.run((2,), launch, 0)
    assert log == ["launch"] * 3 and not g.ok  # failed once: plain from then on
    monkeypatch.setenv("FLASHTUNE_SLOW_LAUNCH", "1")
    state["fail"] = False
    log.clear()
    g = LG.LaunchGraphs()
    for _ in range(3):
        g.run((5,), launch, 0)
    assert log == ["launch"] * 3


def test_buffers_on_another_gpu_than_the_current_take_plain_launches(fake):
    """The launcher runs such launches on their GPU's stream, which a capture on the current
    GPU's side stream would not record: an empty graph replayed would compute nothing."""
    log, state = fake
    g = LG.LaunchGraphs()
    launch = lambda: log.append("launch")  # noqa: E731
    state["current"] = 0
    for _ in range(3):
        g.run((7,), launch, 1)
    assert log == ["launch"] * 3 and not g.graphs
    g.run((7,), launch, 0)
    g.run((7,), launch, 0)
    state["current"] = 1  # the graph of GPU 0's buffers is not replayed with GPU 1 current
    g.run((7,), launch, 0)
    assert log == ["launch"] * 3 + ["launch", "capture", "replay", "launch"]


def test_keys_seen_and_graphs_stay_bounded(fake, monkeypatch):
    log, _ = fake
    monkeypatch.setattr(LG, "_SEEN_MAX", 4)
    monkeypatch.setattr(LG, "_GRAPHS_MAX", 2)
    g = LG.LaunchGraphs()
    for i in range(10):
        g.run((i,), lambda: None, 0)
        g.run((i,), lambda: None, 0)
    assert len(g.seen) <= 4 and len(g.graphs) <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dq", ["gluon", "none"])
def test_gpu_graph_replays_give_the_plain_launches_gradients(dq, monkeypatch):
    """A hopper_bwd plan called repeatedly on the same buffers (replays from the second call),
    with new contents written into them (a replay reads the memory, not a copy), and on other
    buffers: gradients bit for bit those of a plan with graphs turned off, and against the
    float64 reference."""
    import dataclasses
    from flashtune import launch_hopper_bwd as HB
    from flashtune.defaults import default_variant
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    var = dataclasses.replace(default_variant("hopper_bwd", 128, "bfloat16"), dq=dq)
    g = torch.Generator(device="cuda").manual_seed(1)

    def inputs():
        q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(3))
        return q, k, v
    q, k, v = inputs()
    o, lse = flashtune_forward(q, k, v)
    do = torch.randn_like(o)
    plan = HB.HopperBwdPlan(q, k, v, True, None, var)
    monkeypatch.setenv("FLASHTUNE_SLOW_LAUNCH", "1")
    plain = HB.HopperBwdPlan(q, k, v, True, None, var)
    assert not plain.graphs.ok
    want = [torch.empty_like(t) for t in (q, k, v)]

    def step():  # every temporary dies at return: the next step's buffers reuse the addresses
        for w, r in zip(want, plain.run(do, q, k, v, o, lse)):
            w.copy_(r)
        got = plan.run(do, q, k, v, o, lse)
        for a, b in zip(got, want):
            assert torch.equal(a, b) or dq == "none"  # atomics: the order may differ
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=0)
        return [t.clone() for t in got]
    for i in range(6):
        if i == 4:  # new contents at the same addresses
            for t, new in zip((q, k, v), inputs()):
                t.copy_(new)
            o2, lse2 = flashtune_forward(q, k, v)
            o.copy_(o2)
            lse.copy_(lse2)
            do.normal_(generator=g)
            del o2, lse2, t, new
        got = step()
        if i < 5:
            del got
    assert plan.graphs.graphs, f"no graph was captured (capture worked: {plan.graphs.ok}, " \
        f"keys seen once: {len(plan.graphs.seen)})"

    def ref_grads(dtype, fn):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*xs, causal=True), xs, do.to(dtype))
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref_grads(torch.float64, reference),
                             ref_grads(q.dtype, same_dtype_math)):
        report = compare(a, r, b)
        assert report.ok, f"{name}: {report}"


def flashtune_forward(q, k, v):
    from flashtune import ops
    return ops.run_forward(q, k, v, True, None)
