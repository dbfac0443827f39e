"""The search's journal storage (flashtune/journal_file.py): appends from several processes at
once stay whole lines, none lost, and Optuna reads them back as one study; the lock excludes
other processes and other threads."""
import fcntl
import multiprocessing as mp
import os
import threading
import time

import optuna

from flashtune.journal_file import FlockLock
from flashtune.search_study import make_storage


def _writer(url: str, tag: int, n: int) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="s", storage=make_storage(url))
    for i in range(n):
        t = study.ask()
        t.set_user_attr("who", [tag, i])
        study.tell(t, float(tag * 1000 + i))


def test_concurrent_appends_from_processes_are_all_read_back(tmp_path):
    url = f"journal:///{tmp_path}/s.journal"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="s", storage=make_storage(url))
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_writer, args=(url, k, 40)) for k in range(3)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    trials = optuna.load_study(study_name="s", storage=make_storage(url)).get_trials()
    assert sorted(tuple(t.user_attrs["who"]) for t in trials) == [
        (k, i) for k in range(3) for i in range(40)]
    assert all(t.value == t.user_attrs["who"][0] * 1000 + t.user_attrs["who"][1] for t in trials)
    with open(f"{tmp_path}/s.journal", "rb") as f:
        assert f.read().endswith(b"\n")  # whole lines only


def test_the_lock_excludes_other_processes_and_threads(tmp_path):
    path = str(tmp_path / "j.journal")
    lock = FlockLock(path)
    lock.acquire()
    # another open file description (what another process holds) cannot take it meanwhile
    fd = os.open(path + ".lock", os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except BlockingIOError:
            taken = False
        assert not taken
        # another thread of this process waits until it is released
        got = []
        th = threading.Thread(target=lambda: (lock.acquire(), got.append(time.monotonic()),
                                              lock.release()))
        th.start()
        time.sleep(0.3)
        assert not got
        released = time.monotonic()
        lock.release()
        th.join(10)
        assert got and got[0] >= released
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    finally:
        os.close(fd)
