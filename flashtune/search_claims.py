"""What several search processes sharing one Optuna storage agree on, through that storage alone
(no coordinator): who is alive, and who does a job that must be done once (a bucket's final
pick).

- **Owner**: a process is {host, pid, start} (start: its start time in clock ticks since boot,
  where /proc has it). One of this host is alive while its pid is and was started then (a claim
  outlives its process in the storage: a later process, or a PostgreSQL backend, given the same
  pid held two CI runs' searches waiting on it for good, session 24); one of
  another host while its heartbeat (a user attr of the claims study, written every
  HEARTBEAT_S by a thread of each searching process) is younger than STALE_S. A process
  that never wrote one (an older flashtune) counts as alive. A RUNNING trial with no owner yet
  was asked a moment ago (ask() and the owner's write are two storage calls): one older than
  ORPHAN_GRACE_S was asked by a process killed between them.
- **Claims**: `claim(storage, key)` enqueues a WAITING trial carrying the key in the claims
  study (one storage write, atomic on RDB and journal storages, numbered in commit order), then
  reads the claims of that key back: the lowest-numbered claim of a live owner wins. Two
  claimants always agree: whichever claims later sees the earlier one. Nothing ever asks
  the claims study, so its trials stay WAITING until a claim() finds their owner dead and
  marks them FAIL (`_retire`): a claim is read by every later claim() until then.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from functools import lru_cache

import optuna
from optuna.trial import TrialState

CLAIMS_STUDY = "flashtune.claims"
HEARTBEAT_S = 10.0
STALE_S = 60.0
ORPHAN_GRACE_S = 5.0


@lru_cache(maxsize=1)
def _host() -> str:
    return socket.gethostname()


def _stat(pid: int) -> list | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start(fields: list | None) -> int | None:
    """A process's start time (stat field 22, starttime) from _stat's fields, or None."""
    return int(fields[19]) if fields and len(fields) > 19 else None


@lru_cache(maxsize=4)
def _start_of(pid: int) -> int | None:
    """This process's start time, per pid: a forked child does not take its parent's."""
    return _start(_stat(pid))


def me() -> dict:
    start = _start_of(os.getpid())
    return {"host": _host(), "pid": os.getpid(), **({"start": start} if start else {})}


def same(a: dict | None, b: dict | None) -> bool:
    return (bool(a and b) and a.get("host") == b.get("host") and a.get("pid") == b.get("pid")
            and (a.get("start") is None or b.get("start") is None
                 or a.get("start") == b.get("start")))


def _pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether process `pid` lives (a zombie does not) and, given its start time, is the process
    that was started then rather than a later one given the same pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    if fields is None:
        return True
    if fields[0] == "Z":
        return False
    now = _start(fields)
    return start is None or now is None or now == int(start)


def _beat_key(owner: dict) -> str:
    return f"alive:{owner.get('host')}:{owner.get('pid')}"


def claims_study(storage) -> optuna.Study:
    return optuna.create_study(study_name=CLAIMS_STUDY, storage=storage, load_if_exists=True,
                               sampler=optuna.samplers.RandomSampler())


class Liveness:
    """Answers "is this owner alive?" for one storage; other hosts' heartbeats are read at most
    once per `refresh_s`."""

    def __init__(self, storage, refresh_s: float = 5.0):
        self.storage, self.refresh_s = storage, refresh_s
        self._beats: dict = {}
        self._read_at = -1e9
        self._study = None

    def _heartbeats(self) -> dict:
        now = time.monotonic()
        if now - self._read_at > self.refresh_s:
            self._study = self._study or claims_study(self.storage)
            self._beats = dict(self._study.user_attrs)
            self._read_at = now
        return self._beats

    def alive(self, owner: dict | None) -> bool:
        if not owner or not owner.get("pid"):
            return True  # not ours to judge
        if owner.get("host") == _host():
            return _pid_alive(int(owner["pid"]), owner.get("start"))
        beat = self._heartbeats().get(_beat_key(owner))
        return beat is None or time.time() - float(beat) < STALE_S


class Heartbeat:
    """A daemon thread writing this process's heartbeat every HEARTBEAT_S (for other hosts)."""

    def __init__(self, storage, every: float = HEARTBEAT_S):
        self.storage, self.every = storage, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashtune-heartbeat",
                                        daemon=True)

    def start(self) -> "Heartbeat":
        self._study = claims_study(self.storage)
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        try:
            self._study.set_user_attr(_beat_key(me()), time.time())
        except Exception:  # noqa: BLE001 -- a missed beat is retried; the search goes on
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._beat()

    def stop(self) -> None:
        self._stop.set()


def claim(storage, key: str, liveness: Liveness | None = None) -> dict:
    """The owner holding `key` (the earliest claim of a live owner) after this process claims
    it too: `same(claim(...), me())` when this process holds it."""
    study = claims_study(storage)
    mine = me()
    study.enqueue_trial({}, user_attrs={"claim": key, "owner": mine}, skip_if_exists=False)
    liveness = liveness or Liveness(storage)
    held = None
    for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)),
                    key=lambda t: t.number):
        owner = t.user_attrs.get("owner")
        if same(owner, mine) or liveness.alive(owner):
            if held is None and t.user_attrs.get("claim") == key:
                held = owner
        else:
            _retire(study, t)
    return held or mine  # our own claim is among them


def _retire(study: optuna.Study, trial) -> None:
    """Marks a dead owner's claim FAIL, so that no later claim() reads it again: keys repeat
    (a study deleted and made again has the same name), and every claim() reads all WAITING
    claims. Two processes retiring one claim is harmless: the second write fails."""
    try:
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    except Exception:  # noqa: BLE001 -- left WAITING, it is skipped again next time
        pass
