"""The display driver's version for records' provenance: NVML through ctypes (no pynvml, no
nvidia-smi process), with a stand-in library on this CPU machine."""
import ctypes

import pytest

from flashtune import measure_gpu


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
    assert measure_gpu._nvml_driver_version() == "580.159.04"
    assert lib.calls == ["init", "query", "shutdown"]


@pytest.mark.parametrize("lib,calls", [
    (None, None),                                   # no NVML on this machine
    (FakeNvml(init_rc=9), ["init"]),                # NVML there, no driver loaded
    (FakeNvml(query_rc=7), ["init", "query", "shutdown"]),  # the query fails: still shut down
])
def test_no_version_where_nvml_cannot_give_one(monkeypatch, lib, calls):
    _with(monkeypatch, lib)
    assert measure_gpu._nvml_driver_version() == ""
    if lib is not None:
        assert lib.calls == calls


def test_driver_version_prefers_nvml_over_nvidia_smi(monkeypatch):
    _with(monkeypatch, FakeNvml(version=b"555.42.06"))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # pynvml absent
    started = []
    monkeypatch.setattr(measure_gpu.subprocess, "run", lambda *a, **k: started.append(a))
    assert measure_gpu._driver_version() == "555.42.06"
    assert not started  # no nvidia-smi process
