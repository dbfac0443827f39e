"""Error against the float64 reference, judged relative to what PyTorch's own math achieves.

Tolerance (DESIGN.md): flashtune's max error must stay within 2x the max error of PyTorch's
same-dtype math plus the reference's rounding noise (FlashAttention's tests' definition below).
Shared by the tests and by the search's correctness gate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ErrorReport:
    max_err: float
    rms_err: float
    worst_index: tuple
    tolerance: float
    baseline_err: float  # PyTorch same-dtype math vs float64
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.max_err <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{verdict}: max err {self.max_err:.3e} at {self.worst_index}, rms {self.rms_err:.3e}, "
                f"tolerance {self.tolerance:.3e} (PyTorch same-dtype err {self.baseline_err:.3e})"
                + ("" if self.finite else ", output has NaN/Inf"))


def compare(out: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor) -> ErrorReport:
    """out: flashtune's result; ref64: float64 reference; baseline: PyTorch's same-dtype result.

    Computed where `out` lives, one copy of a few scalars back: the search's gate runs this on
    every candidate, and moving the tensors to the CPU in float64 had it cost more than
    timing the kernel (and busy the host's cores that the compile workers need)."""
    dev = out.device
    out64 = out.detach().to(torch.float64)
    ref64 = ref64.detach().to(device=dev, dtype=torch.float64)
    base64 = baseline.detach().to(device=dev, dtype=torch.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: out {tuple(out64.shape)} vs reference {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return ErrorReport(0.0, 0.0, (), 0.0, 0.0, True)
    diff = (out64 - ref64).abs().nan_to_num(nan=float("inf"))
    # the reference's rounding noise, as FlashAttention's tests define it: what adding and
    # subtracting 0.3 in the output dtype does to the reference (an ulp near |ref| + 0.3), x2
    r = ref64.to(out.dtype)
    rounding = 2 * ((r + 0.3 - 0.3) - r).abs().max().to(torch.float64)
    baseline_err = (base64 - ref64).abs().nan_to_num(nan=0.0).max()
    finite = torch.isfinite(out64).all().to(torch.float64)
    stats = torch.stack([diff.max(), diff.pow(2).mean().sqrt(), rounding, baseline_err, finite,
                         diff.flatten().argmax().to(torch.float64)]).tolist()
    max_err, rms, rounding, baseline_err, finite, flat = stats
    worst = _unravel(int(flat), diff.shape)
    tol = 2 * baseline_err + rounding + 1e-12
    return ErrorReport(max_err, rms, worst, tol, baseline_err, bool(finite))


def _unravel(flat: int, shape) -> tuple:
    """The index of element `flat` of a tensor of `shape` (torch.unravel_index imports sympy on
    its first call: 3-4 s of a search's first trial on a busy host)."""
    out = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))
