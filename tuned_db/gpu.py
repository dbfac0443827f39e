"""GPU names as the tuned DB and the tables spell them: slugs, and the architecture of a slug."""
from __future__ import annotations

from flashtune import targets


def gpu_slug(gpu) -> str:
    """"H100", "NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3" or a Target -> the slug."""
    if isinstance(gpu, targets.Target):
        return gpu.slug
    try:
        return targets.get(str(gpu)).slug
    except KeyError:
        return targets.slug_of(str(gpu))


def target_of(gpu) -> targets.Target | None:
    """The registry's Target for a short name, device name or slug (None if unknown)."""
    if isinstance(gpu, targets.Target):
        return gpu
    slug = gpu_slug(gpu)
    for t in targets.TARGETS.values():
        if t.slug == slug:
            return t
    return None
