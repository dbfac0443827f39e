"""Arrival counters for kernels whose programs count each other in (splitkv's fused combine):
int32 words that every launch leaves at 0 when it ends, one area per (device, stream).

Per stream because kernels on one stream run one after another, so a launch finds the words at
0; two streams may run at once and get their own. A CUDA graph keeps the area of the stream it
was captured on: replaying it on another stream beside calls on the capture stream would share
it (torch.cuda.graph captures on a side stream of its own, which runs nothing else). Areas are
never freed (a graph may hold an address) and only grow (by doubling, the old one kept)."""
from __future__ import annotations

import torch

MIN_WORDS = 4096

_areas: dict = {}
_retired: list = []  # outgrown areas a captured graph may still point at


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on `device`, for launches on its current stream. Made on first use
    (under stream capture too: torch.zeros then allocates from the graph's pool and its memset
    becomes a node of the graph, which is harmless -- the words are 0 whenever a launch starts)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    key = (device.type, device.index, stream.cuda_stream if stream is not None else 0)
    area = _areas.get(key)
    if area is None or area.numel() < n:
        if area is not None:
            _retired.append(area)
        size = max(MIN_WORDS, 1 << max(n - 1, 0).bit_length())
        area = _areas[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return area
