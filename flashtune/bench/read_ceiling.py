"""The read ceiling of a decode cell: the same K and V caches streamed once by a plain Triton
kernel (no attention), timed as the bench times the peers. A decode step cannot read its bytes
faster than this on the device, launch and ramp included: at batch 1 and 32k keys of MQA
(16.8 MB a layer) the H100 read 2,016 GB/s so, well under its copy bandwidth (session 28)."""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048                  # elements a program reads per step of its loop
PER_SM = (1, 2, 4, 8)         # programs per SM tried; the fastest is the ceiling


@triton.jit
def read_sum(X, Y, start, per_prog, n, BLOCK: tl.constexpr):
    """Elements [start, start + per_prog) of X and of Y (below n), each read once as a decode
    step reads K and V, summed in float32 BLOCK lanes (the sum checks the read)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, start + per_prog, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < n
        acc += (tl.load(X + idx, mask=ok, other=0.0).to(tl.float32)
                + tl.load(Y + idx, mask=ok, other=0.0).to(tl.float32))
    return acc


@triton.jit
def _stream_read(X, Y, OUT, n, per_prog, BLOCK: tl.constexpr):
    # 64-bit offsets: a GQA B=64 128k cell holds 8.6e9 elements of each cache
    start = tl.program_id(0).to(tl.int64) * per_prog
    tl.store(OUT + tl.program_id(0), tl.sum(read_sum(X, Y, start, per_prog, n, BLOCK), 0))


def split(n: int, programs: int, block: int = BLOCK) -> tuple[int, int]:
    """(programs, elements per program): `n` elements in whole blocks over at most `programs`."""
    per_prog = triton.cdiv(triton.cdiv(n, programs), block) * block
    return triton.cdiv(n, per_prog), per_prog


def fastest(sms: int, time_of) -> tuple[float, int]:
    """(ms, programs) of the fastest grid among PER_SM programs per SM; time_of(programs) times
    a read with that many (the caller's timer: the bench's samples, a script's graph replays)."""
    return min((time_of(sms * per_sm), sms * per_sm) for per_sm in PER_SM)


def reader(x, y, programs: int):
    """A callable that streams x and y (same number of elements, contiguous) once with
    `programs` programs, returning their per-program sums (float32)."""
    import torch
    if x.numel() != y.numel() or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("reader: x and y must be contiguous with as many elements")
    n = x.numel()
    progs, per_prog = split(n, programs)

    def read():
        out = torch.empty(progs, dtype=torch.float32, device=x.device)
        _stream_read[(progs,)](x, y, out, n, per_prog, BLOCK=BLOCK, num_warps=8, num_stages=3)
        return out
    return read
