"""NVML through ctypes, for what must not start CUDA: the driver's version in every timing worker,
the GPU's name in `flashtune search`'s parent (no pynvml: the device image lacks it; no
nvidia-smi process). Each query opens NVML and shuts it down; None where NVML is missing or
fails."""
from __future__ import annotations

import ctypes

LIB = "libnvidia-ml.so.1"


def _query(read, lib_name: str = LIB):
    try:
        lib = ctypes.CDLL(lib_name)
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        return read(lib)
    finally:
        lib.nvmlShutdown()


def _string(call, *args, size: int = 96) -> str | None:
    buf = ctypes.create_string_buffer(size)
    if call(*args, buf, ctypes.c_uint(len(buf))) != 0:
        return None
    return buf.value.decode(errors="replace")


def driver_version(lib_name: str = LIB) -> str:
    """The display driver's version ("" where NVML cannot tell)."""
    return _query(lambda lib: _string(lib.nvmlSystemGetDriverVersion), lib_name) or ""


def gpu_names(lib_name: str = LIB) -> list[str] | None:
    """Every GPU's name, in NVML's order (None where NVML cannot tell)."""
    def read(lib):
        n = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return None
        names = []
        for i in range(n.value):
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0:
                return None
            name = _string(lib.nvmlDeviceGetName, handle)
            if name is None:
                return None
            names.append(name)
        return names
    return _query(read, lib_name)
