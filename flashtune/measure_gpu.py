"""The real measuring backend: compile ahead in compile workers, gate + time on the GPU.

Every candidate first runs on random inputs of a smaller problem that runs the same binary
and must match the float64 reference within DESIGN.md's tolerance (flashtune.accuracy);
only then is it timed on the bucket's problem (median, L2 flushed).
"""
from __future__ import annotations

import importlib
import os
import subprocess
import time
from dataclasses import dataclass

from .measure import Backend, Outcome

_RESOURCE_ERRORS = ("OutOfResources", "CompilationError", "PTXASError")


# A family whose call is a few microseconds (splitkv: a decoding step) times a step of several
# calls as a server replays it (ops.step_inputs / ops.step / ops.layers), per call; the others
# time one call of ops.run on ops.inputs.
def _step_inputs(ops, problem, seed: int):
    make = getattr(ops, "step_inputs", None) or ops.inputs
    return make(problem, seed)


def _step(ops, variant, problem, tin):
    run = getattr(ops, "step", None) or ops.run
    return lambda: run(variant, problem, tin)


def _calls(ops, problem) -> int:
    layers = getattr(ops, "layers", None)
    return layers(problem) if layers else 1


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"


@dataclass(frozen=True)
class GpuBackend(Backend):
    smem_limit: int                  # target.smem_per_block: what a compiled kernel may use
    flush_bytes: int = 256 << 20     # > L2 of any target
    bench_ms: float = 60.0           # timing budget per candidate
    retime_reps: int = 5
    seed: int = 0
    capability: int = 0              # the target's, e.g. 90: compile workers then need no GPU
    # (family, module with OPS) pairs that replace the registry's measuring ops: bench/faults.py
    # swaps in a module that misbehaves on purpose; production leaves it empty.
    family_modules: tuple = ()

    name = "gpu"

    def supports(self, family: str) -> bool:
        from .families import names
        mods = dict(self.family_modules)
        return family in mods if mods else family in names()

    def _ops(self, family: str):
        mods = dict(self.family_modules)
        if mods:
            if family not in mods:
                raise KeyError(f"no measuring function for kernel family {family!r}; known: "
                               f"{sorted(mods)}")
            return importlib.import_module(mods[family]).OPS
        from .families import get
        return get(family).ops

    # -- worker setup ----------------------------------------------------------------------
    def setup(self, role: str, index: int) -> None:
        os.environ.pop("TRITON_INTERPRET", None)
        import torch

        # a worker's host work is small and serial; torch's default, a thread per core in each
        # of the ~16 workers per GPU, has them spin against each other and the compilers
        torch.set_num_threads(1 if role == "compile" else 2)
        if role == "compile":
            if self.capability:
                _compile_without_context(self.capability)
            # the families' measuring modules (codegen, the launchers) are imported now, while
            # the driver starts, not in the search's first compiles (3-4 s each, 16 at once).
            # (torch's symbolic shapes and sympy are not needed: the launchers allocate on meta
            # tensors through flashtune/alloc.py, not torch's meta reference, session 24)
            for family in dict(self.family_modules) or _family_names():
                try:
                    self._ops(family)
                except Exception:  # noqa: BLE001 -- its first compile reports it
                    pass
            # the first compile's hash of Triton, now: setup + first compile stays the same (0.76
            # + 0.07 s here, was 0.43 + 0.40 s), a trial gains where a worker is ready before its
            # first compile comes. Not FIRST_IMPORTS: they cost setup what they spared the compile
            _triton_ahead()
        if role == "time":
            # one GPU per timing worker: pin it before CUDA initializes in this process
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(index + 1)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]
            torch.cuda.init()
        object.__setattr__(self, "_state", {})

    def _cached(self, key, make):
        """Per-worker cache of inputs and references; only the latest problem's are kept."""
        state = self.__dict__.setdefault("_state", {})
        if key not in state:
            for k in [k for k in state if k[0] == key[0]]:
                del state[k]
            state[key] = make()
        return state[key]

    # -- compile workers -------------------------------------------------------------------
    def compile(self, variant, problem):
        try:
            shared = self._ops(variant.family).compile_ahead(variant, problem)
        except Exception as e:  # noqa: BLE001 -- compile errors are a trial's result
            return Outcome.fail("compile", _err(e))
        if shared > self.smem_limit:
            return Outcome.fail("compile", f"out of resources: shared memory {shared} B > "
                                           f"{self.smem_limit} B per block")
        return None

    # -- timing workers --------------------------------------------------------------------
    def measure(self, variant, problem) -> Outcome:
        import torch

        from . import timing

        ops = self._ops(variant.family)
        try:
            gp = ops.gate_problem(problem)
            gin = self._cached(("gate-in", gp.key), lambda: ops.inputs(gp, self.seed))
            ref = self._cached(("gate-ref", gp.key), lambda: ops.reference(gp, gin))
            t0 = time.perf_counter()
            out = ops.run(variant, gp, gin)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            report = ops.check(out, gp, ref)
            if not report.ok:
                return Outcome.fail("gate", str(report), max_err=report.max_err)
            t1 = time.perf_counter()
            tin = self._cached(("time-in", problem.key), lambda: _step_inputs(ops, problem,
                                                                             self.seed + 1))
            fn = _step(ops, variant, problem, tin)
            if getattr(ops, "graphed", False):
                fn = timing.graphed(fn)
            ms, spread = timing.bench(fn, budget_ms=self.bench_ms, flush_bytes=self.flush_bytes)
            ms /= _calls(ops, problem)
            t2 = time.perf_counter()
        except Exception as e:  # noqa: BLE001
            return self._launch_failure(e)
        notes = f"spread {spread:.3f}"
        if first_s > 1.0:  # compile-ahead should have left the binary in Triton's cache
            notes += f"; first call {first_s:.1f} s (recompiled in the timing worker)"
        return Outcome(True, ms, max_err=report.max_err, notes=notes,
                       phases=(("first_call", first_s), ("gate", t1 - t0), ("bench", t2 - t1)))

    def warm(self, problem) -> None:
        """The bucket's gate inputs and float64 reference, its timing inputs, Triton's and CUDA's
        libraries, made while the first candidates compile (the first trial of a process waited
        for the compiles, then made them: 0.7 s of its first call on the H100)."""
        import torch
        from triton.runtime import driver

        driver.active.get_current_target()  # Triton's CUDA driver utilities, loaded
        _triton_ahead(FIRST_IMPORTS)  # the first launch's key and imports (0.4 s of its 0.7 s)
        ops = self._ops(problem.family)
        gp = ops.gate_problem(problem)
        gin = self._cached(("gate-in", gp.key), lambda: ops.inputs(gp, self.seed))
        self._cached(("gate-ref", gp.key), lambda: ops.reference(gp, gin))
        self._cached(("time-in", problem.key), lambda: _step_inputs(ops, problem, self.seed + 1))
        torch.cuda.synchronize()

    def _launch_failure(self, e: BaseException) -> Outcome:
        if type(e).__name__ in _RESOURCE_ERRORS:
            return Outcome.fail("launch", _err(e))
        # anything else may have broken the CUDA context (illegal address, misaligned access):
        # reply, then let the worker exit and come back fresh
        object.__setattr__(self, "poisoned", True)
        return Outcome.fail("launch", _err(e))

    def retime(self, variants, problem, rounds: int) -> list:
        from . import timing

        ops = self._ops(problem.family)
        tin = self._cached(("time-in", problem.key), lambda: _step_inputs(ops, problem,
                                                                         self.seed + 1))
        fns, idx = [], []
        for i, v in enumerate(variants):
            try:
                # another family's variant (search.rival_variants: its ops take the same inputs)
                fn = _step(ops if v.family == problem.family else self._ops(v.family), v,
                           problem, tin)
                fn()
            except (ValueError, TypeError, KeyError) if v.family != problem.family else ():
                continue  # a rival this worker cannot run (refused before any launch)
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ not in _RESOURCE_ERRORS:
                    object.__setattr__(self, "poisoned", True)
                    raise
                continue
            fns.append(timing.graphed(fn) if getattr(ops, "graphed", False) else fn)
            idx.append(i)
        res = timing.interleaved(fns, rounds, self.retime_reps, self.flush_bytes, self.seed)
        out = [None] * len(variants)
        calls = _calls(ops, problem)
        for i, r in zip(idx, res):
            out[i] = None if r is None else (r[0] / calls, *r[1:])
        return out

    def environment(self) -> dict:
        import torch
        import triton

        props = torch.cuda.get_device_properties(0)
        return {"gpu_name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count, "driver": _driver_version(),
                "cuda": str(torch.version.cuda), "torch": torch.__version__,
                "triton": triton.__version__}

    def device_count(self) -> int:
        import torch

        # torch counts through NVML (is_available() would cuInit: in the parent and in each
        # search process of --gpus, beside the timing workers' own CUDA start)
        return torch.cuda.device_count()


def _family_names() -> tuple:
    from .families import names
    return tuple(names())


# What the JIT's binder imports on a process's first kernel (the descriptor types it specializes
# on; Gluon's brings Triton's code generator): 0.04 s of a first compile here, on a CPU
FIRST_IMPORTS = ("triton.tools.tensor_descriptor", "triton.experimental.gluon.nvidia.hopper")


def _triton_ahead(modules: tuple = ()) -> None:
    """Pay now what a process's first Triton compile or launch pays once: triton_key(), Triton's
    hash of its own sources and libtriton (~0.5 GB), lru-cached per process and part of every
    kernel's cache key (0.40 s of a compile worker's 0.55 s first compile on the H100, warm
    caches; 0.33 s here), then `modules`. Not in a thread beside setup's imports: they hold the
    GIL and the hash waited for them (0.57 s against 0.54 s in turn, here). Where triton_key is
    elsewhere or not cached (it is in triton.runtime.cache, lru-cached, in 3.6 and 3.9), the
    first compile pays it as before."""
    try:
        from triton.runtime.cache import triton_key
    except (ImportError, AttributeError):
        triton_key = None
    if hasattr(triton_key, "cache_info"):  # kept for the process: else the work is done twice
        triton_key()
    for name in modules:
        try:
            importlib.import_module(name)
        except (ImportError, AttributeError):  # another Triton: its first kernel imports them
            pass


def _compile_without_context(capability: int) -> None:
    """Let the JIT compile (warm-up, no launch) without a CUDA context in this process.

    The JIT's warm-up asks the driver for the current device, stream and target; with torch
    loaded that is torch's current stream, which creates a context: 0.9 s per compile worker
    alone, 2.8 s each when 30 workers of two GPUs start at once, and ~0.5 GB of the timed GPU's
    memory each. The target is known (the search's), so the answers are given here; the
    binary and its cache key are the ones a launch on that GPU makes (GPUTarget carries the
    capability, not the device). Without these driver methods (another Triton) nothing
    changes.

    The driver is made directly, not through `driver.active`: choosing the active one asks
    torch.cuda.is_available(), a cuInit in every compile worker; 56 of them at once beside four
    timing workers held those workers' own CUDA start (0.3 s alone) for 3.4-5 s on 4 H200s."""
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        active = backends["nvidia"].driver()
        driver.set_active(active)
        target = GPUTarget("cuda", capability, 32)
        active.get_current_device = lambda: 0
        active.get_current_stream = lambda device=None: 0
        active.get_current_target = lambda: target
    except Exception:  # noqa: BLE001 -- an optimisation: the default path still compiles
        pass


def _driver_version() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 -- provenance is best effort
        pass
    from .nvml import driver_version
    v = driver_version()  # NVML through ctypes: no nvidia-smi process in every timing worker
    if v:
        return v
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    except Exception:  # noqa: BLE001
        return ""
