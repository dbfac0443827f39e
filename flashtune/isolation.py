"""Worker processes that a kernel can crash, hang or poison without taking the search along.

Each worker is a process (forked from a server that imported torch, never CUDA: _context)
serving calls over a pipe. A call that does not answer in
time gets its process killed (a hung kernel cannot be interrupted any other way); a process
that dies mid-call (segfault, illegal address, os._exit) turns into WorkerLost with the exit
code or signal. Either way the next call starts a fresh process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

from .timeline import mark


class WorkerLost(Exception):
    """The worker died or was killed during a call; args[0] says how."""


def _describe_exit(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _Profile:
    """FLASHTUNE_PROFILE_DIR=dir: each worker profiles its calls (cProfile) and writes
    dir/<role>-<index>-<pid>.prof when it exits cleanly; without it, nothing."""

    def __init__(self, path: str | None):
        self.path = path
        if path:
            import cProfile
            self.prof = cProfile.Profile()

    def __enter__(self):
        if self.path:
            self.prof.enable()

    def __exit__(self, *exc):
        if self.path:
            self.prof.disable()

    def dump(self) -> None:
        if self.path:
            self.prof.dump_stats(self.path)


def _profiler(role: str, index: int) -> _Profile:
    d = os.environ.get("FLASHTUNE_PROFILE_DIR")
    return _Profile(os.path.join(d, f"{role}-{index}-{os.getpid()}.prof") if d else None)


_CTX = None


def _context():
    """Workers fork from a server process that imported torch once (multiprocessing's
    forkserver), instead of each importing it again: 16 compile workers and a timing worker
    per GPU starting at once took seconds of every search's start-up, and 4 workers 7.4 s on a
    2-core machine (16 from the server: 3.0 s). The server never touches CUDA, so no worker
    inherits a context; it imports only torch (Triton reads TRITON_INTERPRET when a kernel is
    decorated, so it must be imported under each worker's own environment, which _serve sets
    first: the server's is its first caller's)."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # not sympy as well: imported here it held every worker's start ~11 s (H100 x2,
        # session 13); compile workers import it as they start (GpuBackend.setup). Session 22
        # (4x H200, run 23): preloaded, the compile workers set up in 1.1-1.4 s instead of
        # 2.9-3.9 s, but the server forks nothing until its preload is done, so the search
        # processes started 2 s later and the first trials came later (one GPU: 8.7 s after
        # the command, against 6.9 s)
        ctx.set_forkserver_preload(["torch"])
        _CTX = ctx
    return _CTX


def start_server() -> None:
    """Start the workers' server now: its imports run while the caller goes on (resolving the
    GPU, opening the storage, planning), where the first worker's start would wait for them."""
    _context()
    try:
        from multiprocessing import forkserver
        forkserver._forkserver.ensure_running()  # the instance's: share_server may replace it
    except Exception:  # noqa: BLE001 -- the first worker starts it as before
        pass


def server_handle():
    """What a process the workers' server forked needs to ask that same server for workers of
    its own (share_server): the server's socket address and, where this Python has one, its
    authentication key. None while no server runs."""
    from multiprocessing import forkserver
    fs = forkserver._forkserver
    if getattr(fs, "_forkserver_pid", None) is None:
        return None
    return fs._forkserver_address, getattr(fs, "_forkserver_authkey", None)


def share_server(handle) -> bool:
    """In a process the server forked (a search process of `--gpus`): take workers from the
    parent's server instead of starting one of its own, which imported torch again in every
    search process (3.4 s of each run's start-up on two H200s, session 17). multiprocessing
    does not do it by itself: a process the server forks inherits the server's liveness pipe
    but not its key, and the server's pid is not its child to wait on, so the first worker
    would start a new server. False (a server of its own, as before) when there is nothing to
    share."""
    from multiprocessing import forkserver, resource_tracker
    fs = forkserver._forkserver
    if handle is None or getattr(fs, "_forkserver_alive_fd", None) is None \
            or getattr(fs, "_forkserver_pid", None) is not None:
        return False
    fs._forkserver_address, key = handle
    if key is not None:
        fs._forkserver_authkey = key
    # the server is the parent's to start and watch: nothing to start here but the resource
    # tracker, which this process also inherited
    fs.ensure_running = resource_tracker.ensure_running
    return True


def adopt_env(env: dict) -> None:
    """A process forked from the server (_context) takes its caller's environment, not the
    server's (its first caller's)."""
    os.environ.clear()
    os.environ.update(env)


COMPILE_NICENESS = 10


def _yield_cpu() -> None:
    """Compile workers run at a lower priority: a compile waits a little under load, while the
    timing worker's launches and syncs (and the driver's asks) keep their cores. On two H200s,
    with 2 x 15 compile workers on 32 cores, each process's gate took 17 ms a trial where one
    process alone took 8 (docs/benchmarks.md, session 8); compiles are not the queue."""
    try:
        os.nice(COMPILE_NICENESS)
    except OSError:  # not permitted here: the same priority as before
        pass


def _serve(conn, backend, role: str, index: int, env: dict | None = None) -> None:
    if env is not None:
        adopt_env(env)
    # Ctrl-C reaches the whole process group: the driver decides what stops, not the workers
    # (started with SIGINT blocked, so that one during start-up does not kill the import)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # the timeline follows every timing worker and the first compile worker (not all 16-56)
    name = "timing worker" if role == "time" else "compile worker"
    told = role == "time" or index == 0
    # what a search's first trial waits on: these calls' first, timed
    firsts = {"compile", "measure"} if told else set()
    if role == "compile":
        _yield_cpu()
    if told:
        mark(f"{name} {index} forked")
    try:
        backend.setup(role, index)
        if role == "time":
            mark(f"timing worker {index} set up (GPU backend: CUDA initialized)")
            info = backend.environment()
            mark(f"timing worker {index} environment read")
        else:
            info = {}
            if told:
                mark(f"{name} {index} set up")
        conn.send(("ready", info))
    except BaseException as e:  # noqa: BLE001 -- reported to the driver, which gives up
        conn.send(("setup-error", f"{type(e).__name__}: {e}"))
        return
    prof = _profiler(role, index)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return prof.dump()
        if msg is None:
            return prof.dump()
        method, args = msg
        t0 = time.perf_counter() if method in firsts else 0.0
        try:
            with prof:
                reply = ("ok", getattr(backend, method)(*args))
        except BaseException as e:  # noqa: BLE001 -- a failed call is data, not a crash
            reply = ("error", f"{type(e).__name__}: {e}")
        if method in firsts:
            firsts.discard(method)
            mark(f"{name} {index}: first {method} took {time.perf_counter() - t0:.2f} s")
        # the process state may be broken (a CUDA error poisons the context): say so, so the
        # driver replaces this process before its next call
        try:
            conn.send(reply + (backend.poisoned,))
        except OSError:  # the driver is gone (killed): so is this worker's purpose
            return
        if backend.poisoned:
            conn.close()
            os._exit(3)


class Worker:
    """One isolated worker process. Not thread-safe: one thread owns it at a time."""

    def __init__(self, backend, role: str, index: int, *, startup_timeout: float = 300.0):
        self.backend, self.role, self.index = backend, role, index
        self.startup_timeout = startup_timeout
        self.info: dict = {}
        self.restarts = 0
        self._proc = None
        self._conn = None
        self._closed = False
        self._lock = threading.Lock()  # guards kill() racing a restart

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Worker":
        return self.launch().wait_started()

    def launch(self) -> "Worker":
        """Ask the server for the process (it forks in the order asked); wait_started() waits
        for it to be ready."""
        ctx = _context()  # never fork a process that may hold a CUDA context: the server's
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.backend, self.role, self.index,
                                                dict(os.environ)),
                           daemon=True, name=f"flashtune-{self.role}-{self.index}")
        with self._lock:
            if self._closed:
                raise WorkerLost("interrupted")
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self._proc, self._conn = proc, parent
        child.close()
        return self

    def wait_started(self) -> "Worker":
        proc, parent = self._proc, self._conn
        if parent is None:
            raise WorkerLost(f"{self.role} worker {self.index} was killed while starting")
        if not parent.poll(self.startup_timeout):
            self.kill()
            raise WorkerLost(f"{self.role} worker {self.index} did not start in "
                             f"{self.startup_timeout:.0f} s")
        try:
            kind, payload = parent.recv()
        except (EOFError, OSError):
            raise WorkerLost(f"{self.role} worker {self.index} died while starting "
                             f"({_describe_exit(proc.exitcode)})") from None
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"{self.role} worker {self.index} failed to start: {payload}")
        self.info = payload
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def kill(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            conn, self._conn = self._conn, None
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        if conn is not None:
            conn.close()

    def ask_to_exit(self) -> None:
        if self._conn is not None and self.alive():
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass

    def close(self, kill: bool = False) -> None:
        """Stop the worker (politely unless kill); later calls raise WorkerLost."""
        with self._lock:
            self._closed = True
        if not kill and self._conn is not None and self.alive():
            self.ask_to_exit()
            self._proc.join(5)
        self.kill()

    # -- calls -----------------------------------------------------------------------------
    def call(self, method: str, *args, timeout: float):
        """Run backend.<method>(*args) in the worker. Raises WorkerLost if it dies or exceeds
        `timeout` seconds (then it is killed); an exception inside becomes RuntimeError."""
        if self._closed:
            raise WorkerLost("interrupted")
        if not self.alive():
            if self._proc is not None or self._conn is not None:
                self.kill()
                self.restarts += 1
            self.start()  # first call, or after a death: a fresh process
        conn, proc = self._conn, self._proc
        t0 = time.monotonic()
        try:
            conn.send((method, args))
            ready = conn.poll(timeout)
        except (OSError, ValueError, EOFError):
            ready = True  # closed under us: read the reason below
        if not ready:
            self.kill()
            raise WorkerLost(f"timeout: no answer in {timeout:.0f} s (worker killed)")
        try:
            kind, payload, poisoned = conn.recv()
        except (EOFError, OSError, ValueError):
            if self._closed:
                raise WorkerLost("interrupted") from None
            proc.join(5)
            code = proc.exitcode
            self.kill()
            raise WorkerLost(f"worker {_describe_exit(code)} after "
                             f"{time.monotonic() - t0:.1f} s") from None
        if poisoned:
            self.kill()
            self.restarts += 1
        if kind == "error":
            raise RuntimeError(payload)
        return payload
