"""flashtune bench's timing of a cell's peers: measured together, in rotated rounds, so a GPU
whose clock drifts through the cell (the H100 fell 1980 -> 1785 MHz over a minute of load,
session 21) slows every peer alike. A simulated GPU here: each timed run costs a little more
than the one before it."""
import pytest
import torch

from flashtune import timing
from flashtune.bench import timing as bench_timing


@pytest.fixture
def drifting(monkeypatch):
    """The CUDA timer replaced by a GPU whose every run is 0.2% slower than the last; returns
    the log of which fn ran, in order."""
    state = {"runs": 0}
    log = []

    def samples(fn, reps, flush_bytes):
        out = []
        for _ in range(reps):
            fn()
            log.append(fn)
            state["runs"] += 1
            out.append(fn.work * (1.0 + 0.002 * state["runs"]))
        return out

    def warm_gpu(fn, est, warm_ms):
        state["runs"] += 3

    monkeypatch.setattr(timing, "samples", samples)
    monkeypatch.setattr(timing, "warm_gpu", warm_gpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return log


class _Peer:
    def __init__(self, work):
        self.work = work

    def __call__(self):
        return None


def test_identical_peers_time_alike_under_drift(drifting):
    peers = [_Peer(1.0) for _ in range(4)]
    together = [ms for ms, _ in bench_timing.measure_together(peers, "cuda", budget_ms=60.0)]
    assert max(together) / min(together) < 1.02, together
    # one after another, as the bench timed its peers before: the last peer reads ~10% slower
    # than the first for the same work
    alone = [bench_timing.measure_together([p], "cuda", budget_ms=60.0, rounds=1)[0][0]
             for p in peers]
    assert alone[-1] / alone[0] > 1.08, alone
    # and a faster peer still reads faster
    fast = bench_timing.measure_together([_Peer(1.0), _Peer(0.8)], "cuda")
    assert fast[1][0] < 0.85 * fast[0][0]


def test_rounds_go_there_and_back_and_a_failing_peer_is_its_own_error(drifting):
    class Bad(_Peer):
        calls = 0

        def __call__(self):
            Bad.calls += 1
            if Bad.calls > 4:  # its first estimate runs (4 calls), then it breaks
                raise RuntimeError("peer broke")

    a, b, c = _Peer(1.0), Bad(1.0), _Peer(1.0)
    got = bench_timing.measure_together([a, b, c], "cuda", budget_ms=6.0, rounds=4)
    assert isinstance(got[1], RuntimeError) and "peer broke" in str(got[1])
    assert all(isinstance(g, tuple) and g[0] > 0 for g in (got[0], got[2]))
    visits = [fn for i, fn in enumerate(drifting) if i == 0 or drifting[i - 1] is not fn]
    # the estimates a, b, c; then rounds a c | c a | a c | c a (consecutive visits of one fn
    # read as one here)
    assert visits == [a, b, c, a, c, a, c, a], visits


def test_a_decode_replay_that_is_not_its_eager_step_is_an_error():
    # a CUDA-graph replay is checked layer by layer against the step's eager outputs once
    # before it is timed: the agreement check sees layer 0's eager output only, and a replay
    # over freed block tables gave wrong layers at impossible bandwidth (session 29). A fake
    # replay here (CPU): it writes its captured outputs, right or not.
    from flashtune.bench.runner import _replay_differs
    eager = [(torch.randn(2, 1, 4, 8),) for _ in range(4)]
    outs = [torch.empty(2, 1, 4, 8) for _ in range(4)]

    def replay(wrong=()):
        for i, (o, (e,)) in enumerate(zip(outs, eager)):
            o.copy_(e + (1.0 if i in wrong else 1e-3 * torch.randn_like(e)))
    replay.outputs = outs
    assert _replay_differs(replay, eager) is None

    def bad():
        replay(wrong={2})
    bad.outputs = outs
    why = _replay_differs(bad, eager)
    assert why is not None and "layer 2" in why and why.startswith("wrong result")

    def silent():  # writes nothing: the NaN the check fills in stays
        pass
    silent.outputs = outs
    assert "layer 0" in _replay_differs(silent, eager)
    single = outs[0]  # one layer: the capture returned a tensor, not a list

    def one():
        single.copy_(eager[0][0])
    one.outputs = single
    assert _replay_differs(one, eager[:1]) is None


def test_a_peer_whose_exception_is_kept_elsewhere_keeps_nothing_of_the_cell():
    # Inductor keeps a failed compile's exception, and so every frame on the stack when it
    # raised: _prepare's and time_cell's, whose locals held the cell's inputs and the other
    # peers' timed steps (session 30: 16 GiB of caches and 32 GiB of graph pools outlived the
    # GQA B=64 32k decode cell; the next cell's inputs ran out of memory). CPU run, a fake
    # compiler that keeps what it raised.
    import gc
    import weakref

    from flashtune.bench import runner
    from flashtune.bench.grid import Case
    from flashtune.bench.peers import Inputs, Peer

    kept = []

    class Held:  # stands for a peer's CUDA graph: only the peer's timed step refers to it
        pass

    class Good(Peer):
        name = "good"

        def prepare(self, case, inp):
            held = Held()
            step = lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v  # noqa: E731
            step.held = held
            Good.ref = weakref.ref(held)
            return step

    class Failing(Peer):
        name = "failing"

        def prepare(self, case, inp):
            try:
                raise RuntimeError("compile failed")
            except RuntimeError as e:
                kept.append(e)  # as Inductor keeps it
                raise

    case = Case("dense", "fwd", 1, 2, 2, 16, 16, 8, False, dtype="float32")
    inp = Inputs(tuple(torch.randn(1, 2, 16, 8) for _ in range(3)))
    q_ref = weakref.ref(inp.tensors[0])
    rows = runner.time_cell(case, [Good(), Failing()], inp, "cpu", 1.0, False, rounds=1)
    assert "ms" in rows[0] and "compile failed" in rows[1]["error"]
    del inp
    gc.collect()
    assert kept and kept[0].__traceback__ is not None  # still held, as a compiler would
    assert q_ref() is None, "the cell's inputs outlived it"
    assert Good.ref() is None, "a peer's timed step outlived the cell"
