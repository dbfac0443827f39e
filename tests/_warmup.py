"""A stand-in for the JIT's warm-up in the search's compile-ahead tests (the real one needs a GPU
driver): each kernel[grid](...) a launcher makes under measure_warmup.compile_only is recorded,
and nothing may reach it as a tensor (nothing launches)."""
from types import SimpleNamespace

import torch


class Warmup:
    """One kernel's stand-in: records (name, args, grid, kw, the TMA descriptors' block shapes)
    in `calls`; its metadata.shared is `step` times the calls so far (the largest is judged).
    gluon: the kernel takes TMA descriptors, every one over meta tensors."""

    def __init__(self, name: str, calls: list, step: int = 1000, gluon: bool = False):
        self.name, self.calls, self.step, self.gluon = name, calls, step, gluon

    def warmup(self, *args, grid, **kw):
        assert not any(isinstance(a, torch.Tensor) for a in args)  # nothing launches
        descs = [a for a in args if type(a).__name__ == "TensorDescriptor"]
        if self.gluon:
            assert descs and all(d.base.device.type == "meta" for d in descs)
        self.calls.append(SimpleNamespace(name=self.name, args=args, grid=grid, kw=kw,
                                          blocks=[d.block_shape for d in descs]))
        return SimpleNamespace(metadata=SimpleNamespace(shared=self.step * len(self.calls)))


def stub_load(monkeypatch, module, names, **kw) -> list:
    """module.load (a launcher's) returns stand-ins for the kernels `names`; their calls."""
    calls: list = []
    monkeypatch.setattr(module, "load", lambda v: SimpleNamespace(
        **{n: Warmup(n, calls, **kw) for n in names}))
    return calls
