"""A real search on the GPU present: compile-ahead, gate, timing, final pick, DB record."""
import pytest

pytestmark = pytest.mark.gpu


def test_tiny_real_search(tmp_path):
    import optuna

    from flashtune import targets
    from flashtune.search import SearchConfig, plan_of, run_search
    from flashtune.search_progress import NoProgress
    from flashtune.search_study import make_storage, study_name

    target = targets.detect()
    cfg = SearchConfig(gpu="auto", head_dims=(64,), seqlens=(512,), causal=(True,), trials=4,
                       seed=0, compile_workers=2, storage=f"sqlite:///{tmp_path}/o.db",
                       db=f"sqlite:///{tmp_path}/t.db", top_k=2, retime_rounds=2)
    res = run_search(cfg, progress=NoProgress())
    (b,) = res.buckets
    assert b.winner and b.tflops > 0 and res.db_written == 1, b
    pb = plan_of(cfg, target)[0]
    study = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                              storage=make_storage(cfg.storage))
    results = [t.user_attrs["result"] for t in study.trials if "result" in t.user_attrs]
    ok = [r for r in results if r.get("ms")]
    assert ok and all(r["max_err"] >= 0 for r in ok)
    # compile-ahead left the binary in Triton's cache: the timing worker did not recompile
    assert not any("recompiled" in r.get("notes", "") for r in ok), results


@pytest.mark.parametrize("which", ["timing", "bench"])
def test_a_replay_keeps_what_its_step_reads_alive(which):
    # the graph holds raw pointers: a replay whose step's tensors were freed reads whatever the
    # allocator put there next (flashtune bench's paged decode peer: its block tables, then the
    # next peer's tensors). Here the index tensor lives only in the step's closure.
    import torch

    from flashtune import timing
    from flashtune.bench import timing as bench_timing
    src = torch.randn(1 << 16, device="cuda")
    want = torch.randperm(1 << 16, device="cuda")
    out = torch.empty_like(src)

    def make():
        idx = want.clone()
        return lambda: torch.index_select(src, 0, idx, out=out)
    replay = (timing.graphed if which == "timing" else bench_timing.graphed)(make())
    junk = [torch.zeros(1 << 16, dtype=torch.int64, device="cuda") for _ in range(64)]
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, src[want]), "the replay read freed (overwritten) indices"
    del junk


def test_graphed_timing_replays_the_kernels_and_falls_back():
    # splitkv's search times CUDA-graph replays (timing.graphed): the replay must run what fn
    # launches, on fresh data each time, and a fn that cannot be captured is timed as it is
    import torch

    from flashtune import timing
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)

    def fn():
        torch.mul(x, 3.0, out=out)
    replay = timing.graphed(fn)
    assert replay is not fn
    x.normal_()
    out.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3.0)

    def syncing():
        fn()
        return out.sum().item()  # a host sync: not capturable
    assert timing.graphed(syncing) is syncing
    # the refused capture left the device's random generator usable
    assert torch.randn(4, device="cuda").isfinite().all()
    ms, _ = timing.bench(replay, budget_ms=5.0)
    assert ms > 0
