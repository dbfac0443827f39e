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
    """out: flashtune's result; ref64: float64 reference; baseline: PyTorch's same-dtype result."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    base64 = baseline.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: out {tuple(out64.shape)} vs reference {tuple(ref64.shape)}")
    finite = bool(torch.isfinite(out64).all())
    diff = (out64 - ref64).abs().nan_to_num(nan=float("inf"))
    if diff.numel() == 0:
        return ErrorReport(0.0, 0.0, (), 0.0, 0.0, True)
    flat = int(diff.argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    # the reference's rounding noise, as FlashAttention's tests define it: what adding and
    # subtracting 0.3 in the output dtype does to the reference (an ulp near |ref| + 0.3), x2
    r = ref64.to(out.dtype)
    rounding = 2 * ((r + 0.3 - 0.3) - r).abs().max().item()
    baseline_err = (base64 - ref64).abs().nan_to_num(nan=0.0).max().item()
    tol = 2 * baseline_err + rounding + 1e-12
    return ErrorReport(diff.max().item(), diff.pow(2).mean().sqrt().item(), worst, tol,
                       baseline_err, finite)
