"""A plan's kernel launches replayed as one CUDA graph when a call repeats its buffers.

A short backward is host-bound: on the H100 machine the D=128 causal N=512 backward (three
kernels, 366 us of GPU time) took 374 us of host time to issue, and the bench read it at 598 us
(bench/host_bwd.py, session 33): the descriptors, the argument checks and three launches through
Triton's launcher left the GPU idle until the dK/dV kernel's launch. Every one of those launches
depends on the call only through its buffers' addresses (shapes, strides, scale and masks are
the plan's). So a plan hands its launches to `LaunchGraphs.run` with the addresses as the key:

- the first call with a key launches as usual;
- the second captures the launches into a CUDA graph (on a side stream, thread-local capture
  mode: the autograd engine runs backwards on its own thread) and replays it;
- later calls with that key replay it: one cudaGraphLaunch for all the kernels.

A key holds every address a launch reads or writes, so a replay touches exactly the memory the
call's own launches would (the tensors are the call's, alive through the call). Nothing is
allocated inside a capture. The plain launches run instead when the stream is being captured
already (the caller's own CUDA graph, torch.compile's cudagraphs), when a capture fails (then
never again for this plan), when another GPU is current than the buffers', and with
FLASHTUNE_SLOW_LAUNCH=1.
"""
from __future__ import annotations

import torch

from .env import slow_launch
from .launcher import _current_device

# addresses seen once per plan, and graphs per plan: a training step's layers each bring their
# own buffers (one key per layer), a rotating set of buffers would otherwise grow them forever
_SEEN_MAX = 256
_GRAPHS_MAX = 64


class LaunchGraphs:
    """One plan's graphs by key (a tuple of addresses; see the module docstring)."""
    __slots__ = ("seen", "graphs", "ok")

    def __init__(self):
        self.seen: set = set()
        self.graphs: dict = {}
        self.ok = not slow_launch()

    def run(self, key: tuple, launch, device: int) -> None:
        """launch() -- the plan's kernel launches on the current stream, for buffers at the
        addresses `key` holds on GPU `device` -- or its graph's replay. Another GPU current
        than the buffers' takes the plain launches (the launcher makes theirs current for each
        launch, on that GPU's stream: a capture on this one's would record nothing)."""
        if device != _current_device():
            launch()
            return
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.ok or torch.cuda.is_current_stream_capturing():
            launch()
            return
        if key not in self.seen:
            if len(self.seen) >= _SEEN_MAX:
                self.seen.clear()
            self.seen.add(key)
            launch()
            return
        graph = self._capture(launch)
        if graph is None:  # not capturable here: plain launches from now on
            self.ok = False
            launch()
            return
        self.seen.discard(key)
        if len(self.graphs) >= _GRAPHS_MAX:
            self.graphs.clear()
        self.graphs[key] = graph
        graph.replay()

    @staticmethod
    def _capture(launch):
        """launch()'s kernels as a CUDA graph, captured on a side stream that waits for the
        current one (nothing runs); None where the capture fails."""
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=cur.device)
        side.wait_stream(cur)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001 -- a graph is an optimisation, never a failure
            return None
        cur.wait_stream(side)
        return graph
