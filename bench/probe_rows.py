"""What the decode probes (overlap_ceiling, tma_read_probe, warp_split_probe, gluon_decode_probe,
gluon_splitkv, splitkv_timeline) share: their JSON-lines rows, printed as they are written, the
timing of each candidate in 16-layer decode steps (decode_bench's timer: CUDA-graph replays, L2
flushed), the early start's knobs and paged views of a cell's caches."""
from __future__ import annotations

import json
import statistics


class Rows:
    """Rows of a JSON-lines file, each also printed (floats rounded, ms_all left out); the first
    names the device and the torch and triton versions."""

    def __init__(self, path: str, device: str = "cuda"):
        import torch
        import triton
        self.f = open(path, "w")
        self({"kind": "env", "device": torch.cuda.get_device_name() if device == "cuda"
              else device, "torch": torch.__version__, "triton": triton.__version__})

    def __call__(self, row: dict) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
               if k != "ms_all"}, flush=True)

    def close(self) -> None:
        self.f.close()


def time_steps(write, makes: dict, layers: int, reps: int, kv_bytes: int, where: dict) -> None:
    """makes: label -> make(i), layer i's call (a callable of no arguments). `reps` rounds, each
    timing every label's step once in turn, then a row per label: the median ms per layer (and
    every round's), GB/s of K and V."""
    import decode_bench as db
    times = {label: [] for label in makes}
    for _ in range(reps):
        for label, make in makes.items():
            times[label].append(db.bench_ms(db.layered(make, layers)) / layers)
    for label, ts in times.items():
        ms = statistics.median(ts)
        write({**where, "impl": label, "ms": ms, "ms_all": ts, "gbps": kv_bytes / ms / 1e6})


def sum_checked(write, runs: dict, want: float, slack: float, where: dict,
                unchecked=lambda label: False) -> dict:
    """The reads of `runs` (label -> make(i)) whose layer-0 call returns partial sums adding up
    to `want` (every element of K and V; within 1e-3 of |want| + slack), and those `unchecked`
    says return something else; a row with the error for each that fails or cannot run."""
    ok = {}
    for label, make in runs.items():
        try:
            got = make(0)()
            if not unchecked(label):
                s = got.double().sum().item()
                if abs(s - want) > 1e-3 * (abs(want) + slack):
                    raise AssertionError(f"sum {s} != {want}")
            ok[label] = make
        except Exception as e:  # noqa: BLE001 -- a read that cannot run is a row
            write({**where, "impl": label, "error": f"{type(e).__name__}: {e}"[:400]})
    return ok


def parse_configs(text: str, fields: tuple, unset: tuple, required: int = 2) -> list:
    """A probe's --configs: comma-separated configs, each its first fields positional
    ("128/2/..", at least `required` of them), then any of the others by name after colons
    ("128/2:bm=16:nc=1", overriding the positional ones); a field left out takes its `unset`
    value. A tuple of ints per config, in `fields`' order."""
    configs = []
    for c in text.split(","):
        head, *named = c.split(":")
        values = [int(x) for x in head.split("/")]
        if len(values) < required or len(values) > len(fields):
            raise ValueError(f"config {c!r}: {'/'.join(f.upper() for f in fields[:required])} "
                             f"and at most {len(fields)} fields")
        values += unset[len(values):]
        for kv in named:
            name, _, v = kv.partition("=")
            if name not in fields[required:] or not v:
                raise ValueError(f"config {c!r}: {kv!r} is not one of "
                                 f"{', '.join(fields[required:])} = an integer")
            values[fields.index(name)] = int(v)
        configs.append(tuple(values))
    return configs


def early_knobs(plan, pf: int = -1, tf: int = -1, pre: int = -1, steal: int = -1, own: int = 0,
                pace: int = -1, ts: int = -1) -> str:
    """Set the split-KV early start's launch choices a probe overrides on `plan` (a SplitKVPlan;
    -1, own 0: the launch's own): pf MiB of L2 prefetch over all programs, tf 1/0 the combine
    lets the next kernel in before/after its wait, pre tiles loaded before the wait, steal 1/0
    the splits share their tiles past their own (own each), pace K / V halves of the preload in
    flight at most (0: all), ts 1 the partial kernel lets the combine launch at its programs'
    start (gluon). The label suffix naming those set."""
    label = ""
    # (value, unset: the launch's own, the plan's attribute, the label's name, the value set)
    for value, unset, attr, name, conv in (
            (pf, -1, "prefetch_bytes", "pf", lambda v: v << 20),
            (tf, -1, "trigger_first", "tf", bool),
            (pre, -1, "preload", "pre", int),
            (steal, -1, "steal", "steal", bool),
            (own, 0, "steal_own", "own", int),
            (pace, -1, "pace", "pace", int),
            (ts, -1, "trigger_start", "ts", bool)):
        if value > unset:
            setattr(plan, attr, conv(value))
            label += f" {name}{value}"
    return label


def paged_views(kcs, vcs, b: int, nk: int, page: int):
    """Each layer's (b, nk, Hk, D) caches as pages of `page` keys, every sequence's pages in a
    shuffled order: (k pages, v pages, the int32 block table (b, nk // page))."""
    import torch
    per = nk // page
    bt = torch.randperm(b * per, device=kcs[0].device).view(b, per).to(torch.int32)
    kcs, vcs = ([t.view(b * per, page, *t.shape[2:]) for t in ts] for ts in (kcs, vcs))
    return kcs, vcs, bt


def decode_cell(cell: str, layers: int, d: int = 128):
    """A decode cell "B/Hq/Hk/Nk" on the GPU: one bf16 query token per sequence, `layers` K/V
    caches full to Nk (each layer its own), the lengths tensor, the K+V bytes of one layer and
    the variant flashtune dispatches for it: (q, kcs, vcs, seqlens, kv_bytes, variant)."""
    import torch

    from flashtune import kvcache
    b, hq, hk, nk = (int(x) for x in cell.split("/"))
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device="cuda")
    kcs = [torch.randn(b, nk, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    vcs = [torch.randn_like(k) for k in kcs]
    sl = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    var = kvcache._variant(q, kcs[0], vcs[0], False, False, nk)
    return q, kcs, vcs, sl, 2 * b * nk * hk * d * 2, var
