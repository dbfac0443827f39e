"""Two `flashtune search` processes share one study through a real PostgreSQL server
(Optuna's distributed optimisation: no coordinator of our own)."""
import os
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from flashtune import targets
from flashtune.sampler_eval import synthesize
from flashtune.search import SearchConfig, plan_of
from flashtune.search_study import make_storage, study_name

URL = os.environ.get("FLASHTUNE_TEST_POSTGRES")
pytestmark = [pytest.mark.postgres,
              pytest.mark.skipif(not URL, reason="FLASHTUNE_TEST_POSTGRES is not set")]


def test_two_processes_share_one_study(tmp_path):
    h100 = targets.get("H100")
    cfg = SearchConfig(gpu="H100", head_dims=(64,), seqlens=(2048,), causal=(True,))
    pb = plan_of(cfg, h100)[0]
    rec = tmp_path / "rec.jsonl"
    synthesize(rec, h100, [pb.problem], delay_s=0.05)
    name = study_name(pb.space, pb.bucket)
    storage = make_storage(URL)
    try:
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass
    env = dict(os.environ, FLASHTUNE_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "flashtune.cli", "search", "--gpu", "H100", "--replay", str(rec),
         "--family", "fwd",
         "--head-dim", "64", "--seqlen", "2048", "--causal", "true", "--trials", "24",
         "--compile-workers", "1", "--storage", URL, "--db", f"sqlite:///{tmp_path}/t{i}.db",
         "--progress", "lines", "--seed", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    study = optuna.load_study(study_name=name, storage=storage)
    measured = [t for t in study.trials if t.state == TrialState.COMPLETE
                and t.user_attrs["result"].get("measured")]
    owners = {t.user_attrs["owner"]["pid"] for t in measured}
    assert len(owners) == 2, outs  # both processes measured part of the one study
    names = [t.user_attrs["variant"] for t in measured]
    # the budget is the study's, not each process's; a variant the other process measured or
    # was measuring is never measured again
    assert len(names) == len(set(names)) == 24, outs
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    # one pick, by one of them; the other took it from the storage (both DBs hold it)
    final = study.user_attrs["final"]
    assert final["measured"] == 24 and final["result"]["winner"]
    from flashtune.tuned_db import TunedDB
    for i in range(2):
        (r,) = TunedDB(f"sqlite:///{tmp_path}/t{i}.db").records()
        assert r.variant.name == final["result"]["winner"]
    # the other took it from the storage ("picked by") or, done while the picker was still at
    # it, left the bucket to that one ("shared"): never two picks
    assert sum(("picked by" in out) or (" shared" in out) for out in outs) == 1, outs
    optuna.delete_study(study_name=name, storage=storage)
