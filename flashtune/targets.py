"""GPU targets: the limits the feasibility model reads, and detection of the GPU present."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    short: str               # what --gpu takes: "H100"
    name: str                # torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3"
    arch: str                # "sm_90"
    capability: tuple        # (9, 0)
    sm_count: int
    smem_per_block: int      # bytes a block may opt into
    regs_per_sm: int
    peak_tflops_bf16: float  # dense tensor-core, datasheet
    mem_bw_gbps: float       # datasheet
    features: frozenset      # "tma" (tensor descriptors lower to TMA), "wgmma", "warp_specialize"
    l2_bytes: int = 0        # what an L2 flush between timed runs must overwrite
    max_regs_per_thread: int = 255  # above it ptxas spills to local memory
    peak_tflops_fp32: float = 0.0   # tensor-core tf32, dense, datasheet

    @property
    def slug(self) -> str:
        return slug_of(self.name)

    def has(self, feature: str) -> bool:
        return feature in self.features


def slug_of(device_name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3": the shipped table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


_HOPPER = frozenset({"tma", "wgmma", "warp_specialize"})
_MB = 1 << 20
# Datasheet numbers; smem_per_block is the opt-in maximum (cudaDevAttrMaxSharedMemoryPerBlockOptin),
# regs_per_sm is also the most one block may hold (64K 32-bit registers on all of these).
TARGETS = {t.short: t for t in (
    Target("A100", "NVIDIA A100-SXM4-80GB", "sm_80", (8, 0), 108, 166912, 65536, 312.0, 2039.0,
           frozenset(), l2_bytes=40 * _MB, peak_tflops_fp32=156.0),
    Target("H100", "NVIDIA H100 80GB HBM3", "sm_90", (9, 0), 132, 232448, 65536, 989.0, 3350.0,
           _HOPPER, l2_bytes=50 * _MB, peak_tflops_fp32=494.0),
    Target("H200", "NVIDIA H200", "sm_90", (9, 0), 132, 232448, 65536, 989.0, 4800.0, _HOPPER,
           l2_bytes=50 * _MB, peak_tflops_fp32=494.0),
    Target("L40S", "NVIDIA L40S", "sm_89", (8, 9), 142, 101376, 65536, 362.0, 864.0, frozenset(),
           l2_bytes=96 * _MB, peak_tflops_fp32=183.0),
    Target("RTX4090", "NVIDIA GeForce RTX 4090", "sm_89", (8, 9), 128, 101376, 65536, 165.0,
           1008.0, frozenset(), l2_bytes=72 * _MB, peak_tflops_fp32=82.6),
)}


def get(short: str) -> Target:
    key = short.upper().replace(" ", "").replace("-", "")
    for t in TARGETS.values():
        if t.short.upper() == key:
            return t
    raise KeyError(f"unknown GPU {short!r}; known: {', '.join(TARGETS)} (or 'auto')")


def known_by_name(names: list[str] | None) -> Target | None:
    """The target every one of these GPU names is (None: none given, names that differ, or a
    GPU not in TARGETS): detect()'s match of a device's own name."""
    if not names or len(set(names)) != 1:
        return None
    for t in TARGETS.values():
        if t.name == names[0] or slug_of(t.name) == slug_of(names[0]):
            return t
    return None


def detect(device_index: int | None = None) -> Target | None:
    """The target of the GPU present (None without one). Unknown GPUs get a target read off the
    device, with the features its compute capability implies.

    A host whose GPUs are all one known model is told by NVML, without starting CUDA here:
    `flashtune search`'s parent spent 1.2 s of every search's start in cuInit on 4 H200s."""
    import os

    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if (device_index is None and torch.version.cuda is not None  # a CUDA build of torch
            and (visible is None or visible.strip() not in ("", "-1"))):
        from .nvml import gpu_names
        t = known_by_name(gpu_names())
        if t is not None:
            return t

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(idx)
    t = known_by_name([props.name])
    if t is not None:
        return t
    for t in TARGETS.values():  # same chip, other SKU ("H100 PCIe"): closest by short name
        if t.short.lower() in props.name.lower().replace(" ", ""):
            return dataclasses.replace(t, name=props.name, sm_count=props.multi_processor_count)
    cap = (props.major, props.minor)
    return Target(slug_of(props.name), props.name, f"sm_{props.major}{props.minor}", cap,
                  props.multi_processor_count,
                  getattr(props, "shared_memory_per_block_optin", 49152), 65536, 0.0, 0.0,
                  _HOPPER if cap >= (9, 0) else frozenset(),
                  l2_bytes=getattr(props, "L2_cache_size", 0))


def device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class GpuMismatch(ValueError):
    """--gpu names a GPU other than the one present (or there is none)."""


def resolve(gpu: str, *, present: Target | None | bool = True) -> Target:
    """The target for a --gpu value, checked against the GPU present.

    gpu: a short name ("H100") or "auto" (the GPU present). present: the detected target, None
    for "no GPU here", or True to detect now; False skips the check (--dry-run inspects any GPU).
    """
    if present is True:
        present = detect()
    if gpu.strip().lower() == "auto":
        if present is False:
            raise GpuMismatch("--gpu auto needs a GPU to detect; name one (--gpu H100) to inspect "
                              "its space without a GPU")
        if present is None:
            raise GpuMismatch("--gpu auto: no CUDA GPU found (torch.cuda.is_available() is False); "
                              "to see a GPU's search space without one, name it and add "
                              "--dry-run (--gpu H100 --dry-run)")
        return present
    try:
        want = get(gpu)
    except KeyError as e:
        raise GpuMismatch(f"--gpu {e.args[0]}") from None
    if present is False:
        return want
    if present is None:
        raise GpuMismatch(f"--gpu {want.short}: no CUDA GPU found on this machine "
                          "(torch.cuda.is_available() is False); --dry-run shows the search "
                          "space without one")
    if present.short != want.short:
        raise GpuMismatch(f"--gpu {want.short} does not match the GPU present: {present.name} "
                          f"({present.short}); pass --gpu {present.short} or --gpu auto")
    return present
