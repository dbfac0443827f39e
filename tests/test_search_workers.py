"""--workers N on the CPU: replayed "GPUs" whose every measurement takes a while (the replay
backend's delay_s, a sleep in the timing worker), so a bucket's wall time is timing-bound and
should shrink about N-fold with N timing workers -- without losing or repeating a trial.
"""
import json
import os
import time

import optuna
import pytest
from optuna.trial import TrialState

from flashtune import targets
from flashtune.measure import Backend, Outcome
from flashtune.measure_gpu import FIRST_IMPORTS
from flashtune.pipeline import Pipeline
from flashtune.replay import ReplayBackend
from flashtune.sampler_eval import synthesize
from flashtune.search import SearchConfig, plan_of, run_search
from flashtune.search_progress import NoProgress
from flashtune.search_study import make_storage, study_name

H100 = targets.get("H100")
BASE = dict(gpu="H100", families=("fwd",), head_dims=(64,), seqlens=(1024,), causal=(False,),
            compile_workers=1, enqueue_default=False, seed=0, top_k=3, write_db=False)
DELAY, TRIALS = 0.4, 10


def _search(tmp_path, rec, workers):
    # the default measured inside the study (as production does), not gated alone after it at
    # the final pick: that serial step would blur the ratio this test is about
    cfg = SearchConfig(**dict(BASE, replay=rec, trials=TRIALS, workers=workers,
                              enqueue_default=True,
                              storage=f"sqlite:///{tmp_path}/optuna-{workers}.db"))
    t0 = time.monotonic()
    res = run_search(cfg, progress=NoProgress())
    (b,) = res.buckets
    pb = plan_of(cfg, H100)[0]
    study = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                              storage=make_storage(cfg.storage))
    measured = [t.user_attrs for t in study.get_trials(deepcopy=False,
                                                       states=(TrialState.COMPLETE,))
                if t.user_attrs.get("result", {}).get("measured")]
    return b, measured, time.monotonic() - t0


def test_two_timing_workers_halve_a_timing_bound_bucket(tmp_path):
    rec = tmp_path / "rec.jsonl"
    cfg = SearchConfig(**BASE)
    synthesize(rec, H100, [pb.problem for pb in plan_of(cfg, H100)], fail_rate=0.0,
               delay_s=DELAY)
    one, m1, wall1 = _search(tmp_path, str(rec), 1)
    two, m2, wall2 = _search(tmp_path, str(rec), 2)
    for b, m in ((one, m1), (two, m2)):
        names = [a["variant"] for a in m]
        assert b.status == "done" and b.winner and b.measured == TRIALS
        assert len(names) == len(set(names)) == TRIALS  # none lost, none measured twice
    # every measurement sleeps DELAY in a timing worker: one worker cannot beat TRIALS x DELAY
    assert one.wall_s >= TRIALS * DELAY * 0.95, one.wall_s
    # both "GPUs" measured, and the bucket took about half as long (ideal: 0.5)
    devices = {a["result"]["notes"] for a in m2}
    assert devices == {"replayed on device 0", "replayed on device 1"}, devices
    assert {a["result"]["notes"] for a in m1} == {"replayed on device 0"}
    ratio = two.wall_s / one.wall_s
    assert ratio <= 0.65, (f"2 workers: bucket {two.wall_s:.2f} s (search {wall2:.2f} s), "
                           f"1 worker: {one.wall_s:.2f} s (search {wall1:.2f} s)")


def test_depth_keeps_a_candidate_waiting_behind_each_timing_worker(tmp_path):
    rec = tmp_path / "rec.jsonl"
    synthesize(rec, H100, [pb.problem for pb in plan_of(SearchConfig(**BASE), H100)],
               fail_rate=0.0)
    p = Pipeline(ReplayBackend(str(rec)), devices=(0, 1, 2), compile_workers=2)
    try:
        assert p.depth == 2 + 2 * 3
    finally:
        p.close()


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:  # field 19, after the parenthesized command name
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_compile_workers_yield_the_cpu_to_the_timing_worker(tmp_path):
    """Compile workers run COMPILE_NICENESS lower than the timing worker: under load the timing
    worker's launches and syncs keep their cores (on two H200s each process's gate took twice
    as long with 30 compile workers on 32 cores)."""
    import os

    from flashtune.isolation import COMPILE_NICENESS, Worker
    path = tmp_path / "rec.jsonl"
    synthesize(path, H100, [pb.problem for pb in plan_of(SearchConfig(**BASE), H100)])
    backend = ReplayBackend(str(path))
    workers = [Worker(backend, role, 0).start() for role in ("compile", "time")]
    try:
        compile_nice, time_nice = (_niceness(w._proc.pid) for w in workers)
    finally:
        for w in workers:
            w.close(kill=True)
    mine = os.nice(0)
    assert time_nice == mine and compile_nice == min(19, mine + COMPILE_NICENESS)


class _WarmProbe(Backend):
    """A timing worker that says whether warm() ran (and for which problem) before measure()."""
    name = "warmprobe"

    def warm(self, problem) -> None:
        time.sleep(0.5)  # as a reference on a GPU: the caller must not wait for it
        os.environ["FLASHTUNE_WARMED"] = problem.key

    def measure(self, variant, problem) -> Outcome:
        return Outcome(True, 1.0, notes=os.environ.get("FLASHTUNE_WARMED", "cold"))


def test_timing_workers_warm_in_the_background_before_the_first_trial():
    """Pipeline.warm returns at once; the first trial's timing waits for the warm-up and finds
    it done (on a GPU: the bucket's reference and CUDA's libraries, ~3 s of the first trial)."""
    from flashtune.codegen import Variant
    from flashtune.problem import Problem
    p = Problem("fwd", "float16", 64, False, 1, 1, 2, 128, 128)
    pipe = Pipeline(_WarmProbe(), devices=(0,), compile_workers=1).start()
    try:
        t0 = time.monotonic()
        pipe.warm(p)
        assert time.monotonic() - t0 < 0.2
        out = pipe.submit(Variant.parse("fwd-m16-n16-w4-s1"), p).result(timeout=30)
    finally:
        pipe.close()
    assert out.ok and out.notes == p.key, out


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (setup() edits the process: TRITON_INTERPRET, torch's
    threads); returns its last printed line."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_compile_workers_hash_triton_in_setup():
    """setup("compile") leaves triton_key() computed (lru-cached for the process), so a
    compile worker's first compile does not hash Triton's sources and libtriton (0.40 s of its
    0.55 s on the H100, on warm caches)."""
    code = ("from flashtune.measure_gpu import GpuBackend; "
            "GpuBackend(smem_limit=1 << 20).setup('compile', 0); "
            "from triton.runtime.cache import triton_key; print(triton_key.cache_info().currsize)")
    assert _fresh(code) == "1"


def test_timing_workers_warm_triton_before_the_first_launch():
    """warm() (while the first candidates compile) also computes triton_key() and imports what
    the JIT's binder imports on a first kernel: the timing worker's first launch paid them
    (0.4 s of its 0.7 s first call on the H100). No GPU here: the driver, the family's ops and
    the synchronize are stood in for."""
    code = """
import json, sys, types, torch
from triton.runtime import driver
from triton.runtime.cache import triton_key
from flashtune.measure_gpu import FIRST_IMPORTS, GpuBackend
from flashtune.problem import Problem
driver.set_active(types.SimpleNamespace(get_current_target=lambda: None))
torch.cuda.synchronize = lambda: None
made = []
ops = types.SimpleNamespace(gate_problem=lambda p: p, inputs=lambda p, s: made.append(s) or s,
                            reference=lambda p, x: made.append("ref"))
sys.modules["_stub_ops"] = types.SimpleNamespace(OPS=ops)
state = lambda: [triton_key.cache_info().currsize, sorted(m for m in FIRST_IMPORTS
                                                          if m in sys.modules)]
before = state()
GpuBackend(smem_limit=1, family_modules=(("fwd", "_stub_ops"),)).warm(
    Problem("fwd", "float16", 64, False, 1, 1, 2, 128, 128))
print(json.dumps([before, state(), made]))
"""
    before, after, made = json.loads(_fresh(code))
    assert before[0] == 0 and "triton.experimental.gluon.nvidia.hopper" not in before[1]
    assert after == [1, sorted(FIRST_IMPORTS)], after
    assert made == [0, "ref", 1]  # the gate's inputs and reference, the timing inputs, as before


def test_the_gate_does_not_import_sympy():
    """accuracy.compare (every trial's gate) leaves sympy unimported: torch.unravel_index
    imported it, 3-4 s of each search process's first trial on the H100 x2."""
    import subprocess
    import sys
    code = ("import sys, torch; from flashtune.accuracy import compare; "
            "a = torch.randn(2, 3, 5, 7, dtype=torch.float16); r = a.double(); r[1, 2, 3, 4] += 1;"
            "rep = compare(a, r, a.float()); assert rep.worst_index == (1, 2, 3, 4), rep.worst_index;"
            "print('sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_worker_server_starts_without_waiting_for_its_imports():
    """`flashtune search` starts the workers' server first (isolation.start_server): the
    server imports torch while the search resolves the GPU and opens its storage, and the call
    does not wait for that import (~1 s here); workers then fork from it."""
    import subprocess
    import sys
    code = ("import time; from flashtune.isolation import start_server, _context; "
            "from multiprocessing import forkserver; t = time.monotonic(); start_server(); "
            "took = time.monotonic() - t; assert forkserver._forkserver._forkserver_pid, 'none'; "
            "p = _context().Process(target=time.sleep, args=(0,)); p.start(); p.join(60); "
            "print(round(took, 3), p.exitcode)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    took, exitcode = out.stdout.split()
    assert float(took) < 0.5 and exitcode == "0", out.stdout


def test_search_starts_the_server_before_importing_torch():
    """`flashtune search` starts the workers' server before the CLI's own imports (torch among
    them), so both import torch at once; `import flashtune` alone imports no torch, and the
    public names import it on first use."""
    import subprocess
    import sys
    code = ("import sys; sys.argv = ['flashtune', 'search', '--gpu', 'H100'];"
            "import flashtune; assert 'torch' not in sys.modules, 'flashtune imported torch';"
            "import flashtune.cli; from multiprocessing import forkserver;"
            "assert forkserver._forkserver._forkserver_pid, 'no server';"
            "assert callable(flashtune.attention) and 'attention' in dir(flashtune);"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("argv,early", [
    (["search", "--gpu", "H100"], True), (["search", "--dry-run"], False),
    (["search", "--status"], False), (["search", "--help"], False), (["db", "export"], False),
    ([], False)])
def test_only_a_search_that_measures_starts_the_server_early(argv, early):
    from flashtune.cli import _search_starts_early
    assert _search_starts_early(argv) is early


def test_timing_workers_fork_before_compile_workers(monkeypatch):
    """The server forks in the order asked: the timing worker (CUDA's start, the longest) is
    asked first, not behind 16 compile workers (session 17: 3.4 s of each search's start-up)."""
    from flashtune import isolation
    asked = []
    real = isolation.Worker.launch

    def launch(self):
        asked.append(self.role)
        return real(self)
    monkeypatch.setattr(isolation.Worker, "launch", launch)
    pipe = Pipeline(_WarmProbe(), devices=(0,), compile_workers=3).start()
    try:
        deadline = time.monotonic() + 60
        while len(asked) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pipe.close()
    assert asked == ["time", "compile", "compile", "compile"], asked


_SHARE_SCRIPT = '''
import os
from multiprocessing import forkserver


def report(q):
    q.put(("worker", os.getppid()))


def search_process(handle, q, share):
    from flashtune.isolation import _context, share_server
    shared = share_server(handle) if share else False
    p = _context().Process(target=report, args=(q,))
    p.start()
    p.join(60)
    q.put(("shared", shared))


if __name__ == "__main__":
    from flashtune.isolation import _context, server_handle, start_server
    start_server()
    ctx = _context()
    q = ctx.Queue()
    for share in (True, False):
        p = ctx.Process(target=search_process, args=(server_handle(), q, share))
        p.start()
        p.join(120)
        got = dict(q.get(timeout=10) for _ in range(2))
        print(share, got["shared"], got["worker"] == forkserver._forkserver._forkserver_pid)
'''


def test_search_processes_take_their_workers_from_the_parents_server(tmp_path):
    """A `--gpus` search process (forked by the workers' server) asks the parent's server for
    its workers (isolation.share_server) instead of starting a server of its own, which imported
    torch again in each process: its worker's parent is the parent's server. Without the
    handle (the second line) the same code gets a new server, which the check tells apart."""
    import subprocess
    import sys
    script = tmp_path / "share.py"
    script.write_text(_SHARE_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["True True True", "False False False"], out.stdout
