"""Fault injection through the real GPU measuring backend: five broken candidates must each
fail with their reason while the search finishes and none of them reaches the tuned DB.

    python3 bench/faults.py            # on a GPU; about a minute; $OUT/faults.json

The faults are acted out by a family-ops module (this file's OPS) that GpuBackend is told to
use through its `family_modules` argument -- a test hook only this script sets. Everything
else is the production path: compile workers, the feasibility-free compile check, timing
worker, correctness gate, timeouts and restarts.

    compile   the compile step compiles a kernel with a type error (Triton CompilationError)
    smem      a real variant too big for shared memory, sent to the compiler unpruned
    hang      the timed run launches a kernel that spins forever (worker killed at timeout)
    oob       the timed run writes far out of bounds (illegal address; worker restarted)
    wrong     the output is 25% off (the gate against float64 rejects it)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashtune.measure_fwd import FwdOps  # noqa: E402

FAULTS = {
    "fwd-m64-n64-w4-s2": "compile",
    "fwd-m128-n128-w8-s4-loads=descriptor": "smem",
    "fwd-m64-n32-w4-s3": "hang",
    "fwd-m64-n64-w4-s3": "oob",
    "fwd-m128-n32-w4-s2": "wrong",
}
EXPECTED = {"compile": "compile", "smem": "compile", "hang": "timeout", "oob": "launch",
            "wrong": "gate"}
GOOD = ["fwd-m128-n64-w4-s3", "fwd-m128-n64-w8-s2", "fwd-m64-n64-w4-s4"]


@triton.jit
def _type_error(X, N: tl.constexpr):
    x = tl.load(X + tl.arange(0, N))
    tl.store(X + tl.arange(0, N), tl.dot(x, x))  # a 1-D dot does not type-check


@triton.jit
def _spin(FLAG):
    while tl.load(FLAG, volatile=True) == 0:
        pass


@triton.jit
def _wild_store(X):
    offs = tl.arange(0, 16).to(tl.int64) + (1 << 40)  # a terabyte past the buffer
    tl.store(X + offs, tl.zeros([16], dtype=tl.float32))


class FaultyFwdOps(FwdOps):
    def compile_ahead(self, variant, p):
        if FAULTS.get(variant.name) == "compile":
            _type_error.warmup(torch.float32, 16, grid=(1,))
        return super().compile_ahead(variant, p)

    def run(self, variant, p, inputs):
        fault = FAULTS.get(variant.name)
        if fault == "hang":
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            _spin[(1,)](flag)
            torch.cuda.synchronize()
        elif fault == "oob":
            x = torch.zeros(16, dtype=torch.float32, device="cuda")
            _wild_store[(1,)](x)
            torch.cuda.synchronize()
        out = super().run(variant, p, inputs)
        return out * 1.25 if fault == "wrong" else out


OPS = FaultyFwdOps()


def main() -> int:
    from flashtune import targets
    from flashtune.codegen import Variant
    from flashtune.measure_gpu import GpuBackend
    from flashtune.search import SearchConfig, plan_of, run_search
    from flashtune.search_progress import make_progress
    from flashtune.search_study import make_storage, open_study, make_sampler, study_name
    from flashtune.tuned_db import TunedDB

    target = targets.detect()
    if target is None:
        print("faults.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="flashtune-faults-"))
    tmp = Path(tempfile.mkdtemp(prefix="flashtune-faults-"))
    # D=128: the smem variant needs 289 KiB there (Q + 4 stages of K and V tiles)
    cfg = SearchConfig(gpu=target.short, head_dims=(128,), seqlens=(1024,), causal=(False,),
                       trials=len(FAULTS) + len(GOOD), sampler="random", seed=0,
                       storage=f"sqlite:///{tmp}/optuna.db", db=f"sqlite:///{tmp}/tuned.db",
                       prune=False, enqueue_default=False, trial_timeout_s=30.0, top_k=3,
                       resume=True)  # the study below, fresh and with the faults enqueued
    pb = plan_of(cfg, target)[0]
    study = open_study(make_storage(cfg.storage), study_name(pb.space, pb.bucket),
                       make_sampler("random", pb.space, 0), fresh=True)
    for name in list(FAULTS) + GOOD:
        study.enqueue_trial(pb.space.optuna_params(Variant.parse(name)))
    backend = GpuBackend(smem_limit=target.smem_per_block,
                         family_modules=(("fwd", "bench.faults"),))
    t0 = time.monotonic()
    res = run_search(cfg, backend=backend, target=target, progress=make_progress("lines"))
    wall = time.monotonic() - t0
    (b,) = res.buckets
    why = {n: (s, r) for n, s, r in b.failures}
    db_variants = {r.variant.name for r in TunedDB(cfg.db).records()}
    rows, ok = [], True
    for name, fault in FAULTS.items():
        stage, reason = why.get(name, ("-", "did not fail"))
        passed = stage == EXPECTED[fault] and name not in db_variants
        ok &= passed
        rows.append({"fault": fault, "variant": name, "stage": stage, "reason": reason[:300],
                     "expected_stage": EXPECTED[fault], "in_db": name in db_variants,
                     "pass": passed})
    ok &= b.winner in GOOD and res.db_written == 1
    (out / "faults.json").write_text(json.dumps(
        {"rows": rows, "winner": b.winner, "wall_s": wall, "pass": ok}, indent=2))
    print(f"\nfault injection on {target.name}: search finished in {wall:.0f} s, winner "
          f"{b.winner} ({'in' if b.winner in db_variants else 'NOT in'} the DB)")
    print(f"{'fault':<8} {'variant':<40} {'stage':<8} {'ok':<4} reason")
    for r in rows:
        print(f"{r['fault']:<8} {r['variant']:<40} {r['stage']:<8} "
              f"{'yes' if r['pass'] else 'NO':<4} {r['reason'][:90]}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
