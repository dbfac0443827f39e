"""The display driver's version for records' provenance: NVML through ctypes (no pynvml, no
nvidia-smi process), with a stand-in library on this CPU machine."""
import ctypes

import pytest

from flashtune import measure_gpu, nvml


class FakeNvml:
    def __init__(self, init_rc=0, query_rc=0, version=b"580.159.04"):
        self.init_rc, self.query_rc, self.version = init_rc, query_rc, version
        self.calls = []

    def nvmlInit_v2(self):
        self.calls.append("init")
        return self.init_rc

    def nvmlSystemGetDriverVersion(self, buf, length):
        self.calls.append("query")
        assert length.value == len(buf)  # the buffer's real size
        if self.query_rc == 0:
            buf.value = self.version
        return self.query_rc

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0


def _with(monkeypatch, lib):
    def cdll(name):
        if lib is None:
            raise OSError(f"{name}: cannot open shared object file")
        return lib
    monkeypatch.setattr(ctypes, "CDLL", cdll)


def test_reads_the_version_and_shuts_nvml_down(monkeypatch):
    lib = FakeNvml()
    _with(monkeypatch, lib)
    assert nvml.driver_version() == "580.159.04"
    assert lib.calls == ["init", "query", "shutdown"]


@pytest.mark.parametrize("lib,calls", [
    (None, None),                                   # no NVML on this machine
    (FakeNvml(init_rc=9), ["init"]),                # NVML there, no driver loaded
    (FakeNvml(query_rc=7), ["init", "query", "shutdown"]),  # the query fails: still shut down
])
def test_no_version_where_nvml_cannot_give_one(monkeypatch, lib, calls):
    _with(monkeypatch, lib)
    assert nvml.driver_version() == ""
    if lib is not None:
        assert lib.calls == calls


def test_driver_version_prefers_nvml_over_nvidia_smi(monkeypatch):
    _with(monkeypatch, FakeNvml(version=b"555.42.06"))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # pynvml absent
    started = []
    monkeypatch.setattr(measure_gpu.subprocess, "run", lambda *a, **k: started.append(a))
    assert measure_gpu._driver_version() == "555.42.06"
    assert not started  # no nvidia-smi process


class FakeNvmlDevices(FakeNvml):
    """NVML with GPUs: their count, handles and names."""

    def __init__(self, names, **kw):
        super().__init__(**kw)
        self.names = names

    def nvmlDeviceGetCount_v2(self, count):
        self.calls.append("count")
        count._obj.value = len(self.names)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index.value + 1
        return 0

    def nvmlDeviceGetName(self, handle, buf, length):
        assert length.value == len(buf)
        buf.value = self.names[handle.value - 1].encode()
        return 0


def test_gpu_names_in_nvml_order(monkeypatch):
    lib = FakeNvmlDevices(["NVIDIA H200", "NVIDIA H200"])
    _with(monkeypatch, lib)
    assert nvml.gpu_names() == ["NVIDIA H200", "NVIDIA H200"]
    assert lib.calls == ["init", "count", "shutdown"]
    _with(monkeypatch, None)
    assert nvml.gpu_names() is None


@pytest.mark.parametrize("names,want", [
    (["NVIDIA H200"] * 4, "H200"),
    (["NVIDIA H100 80GB HBM3"], "H100"),
    (["NVIDIA H100 80GB HBM3", "NVIDIA H200"], None),  # mixed: CUDA's own order decides
    (["NVIDIA GeForce RTX 5090"], None),                # not in TARGETS: read off the device
    ([], None),
    (None, None),
])
def test_a_host_of_one_known_model_is_told_by_name(names, want):
    from flashtune import targets
    t = targets.known_by_name(names)
    assert (t.short if t else None) == want


def test_detect_asks_nvml_before_cuda(monkeypatch):
    """Where NVML names one known model, detect() answers without torch.cuda (no cuInit); a
    CPU build of torch, CUDA_VISIBLE_DEVICES="" or an unknown GPU go the torch way."""
    import torch

    from flashtune import targets
    _with(monkeypatch, FakeNvmlDevices(["NVIDIA H200"] * 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(
        AssertionError("torch.cuda asked")))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert targets.detect().short == "H200"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert targets.detect() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert targets.detect() is None
