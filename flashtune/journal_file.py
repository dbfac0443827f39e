"""The journal file the search's processes share on one host: Optuna's JournalFileBackend with a
kernel lock and no fsync per append.

Optuna's default lock (a symlink) is polled: a process that finds it taken sleeps 1 ms, then
2, 4, ... up to 1 s, so two processes appending in turn (two GPUs' drivers, ~13 appends per
proposal each) wait far longer than the appends take, and `--gpus 0,1` searched no faster than
one GPU. flock() waiters sleep in the kernel and wake when it is released.

Each append is one write() to a file opened O_APPEND, not fsynced: it survives kill -9 (it is
in the kernel once write() returns); a power loss may drop the last appends. That is the
SQLite storage's policy here (synchronous=NORMAL), and it saves an fsync per append.
Readers are Optuna's: they parse only whole lines, so a reader never sees half an append.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading

from optuna.storages.journal import JournalFileBackend


class FlockLock:
    """An exclusive flock() on `<journal>.lock`, held by one thread of one process at a time
    (Optuna's lock interface: acquire, release)."""

    def __init__(self, journal_path: str):
        self.path = journal_path + ".lock"
        self._threads = threading.Lock()
        self._fd: int | None = None

    def acquire(self) -> bool:
        self._threads.acquire()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._threads.release()
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._threads.release()


class JournalFile(JournalFileBackend):
    def __init__(self, path: str):
        self.path, self.flock = path, FlockLock(path)  # ours: the base class keeps them private
        super().__init__(path, lock_obj=self.flock)

    def append_logs(self, logs: list[dict]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        self.flock.acquire()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:  # one write() in practice; a short write continues where it stopped
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        finally:
            self.flock.release()
