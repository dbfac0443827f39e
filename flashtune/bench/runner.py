"""Run the cases against the peers: one row per (case, peer) with its time and throughput, or
why it was skipped, or its error. Inputs are made once per case and shared by every peer."""
from __future__ import annotations

import datetime
import gc
import platform
import traceback

import torch

from . import grid
from .grid import Case
from .peers import Inputs, Peer, Unavailable, make_inputs
from .progress import Progress
from .report import OURS, case_key, write_json
from .timing import ceilings, measure_together, peak_mib, timed_form

_SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9}


def environment(device: str) -> dict:
    import triton

    import flashtune
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "torch": torch.__version__, "triton": triton.__version__,
           "flashtune": flashtune.__version__, "python": platform.python_version(),
           "device_kind": device}
    if device == "cuda":
        from ..measure_gpu import _driver_version
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", driver=_driver_version(),
                   cuda=str(torch.version.cuda))
    else:
        from ..env import triton_interprets
        env.update(device=f"CPU ({platform.processor() or platform.machine()})",
                   note="Triton interpreter: a smoke run, the numbers mean nothing"
                   if triton_interprets() else "no GPU")
    return env


def _timed(case: Case, fn, inp: Inputs):
    """fn(*tensors) -> the callable the case's mode times, and what it computed (the output,
    or the gradients) to compare between peers."""
    if case.mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(*inp.tensors)
        return run, (run(),)
    xs = [t.detach().requires_grad_() for t in inp.tensors]
    out = fn(*xs)
    gen = torch.Generator(device=out.device).manual_seed(1)
    if case.section == "bnhd":  # dO in (B, N, H, D) memory too, as a model's gradient comes
        b, h, n, d = out.shape
        do = torch.randn(b, n, h, d, generator=gen, device=out.device,
                         dtype=out.dtype).transpose(1, 2)
    else:
        do = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    if case.mode == "bwd":  # the backward alone, on one saved graph
        call = lambda: torch.autograd.grad(out, xs, do, retain_graph=True)  # noqa: E731
    else:
        call = lambda: torch.autograd.grad(fn(*xs), xs, do)  # noqa: E731
    return call, call()


def _max_diff(a: tuple, b: tuple) -> float | None:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


WRONG = 0.1  # of the reference's largest magnitude: far past bf16 rounding, a wrong answer


def _wrong(diff: float, ref: tuple) -> str | None:
    """Why a peer's result is not flashtune's (float64-tested) answer to the case, if it is not."""
    scale = max(1.0, max(t.float().abs().max().item() for t in ref))
    if diff == diff and diff <= WRONG * scale:
        return None
    # one text for every such cell (the report groups errors by text); max_abs_diff says how far
    return (f"wrong result: differs from flashtune's by more than {WRONG:g} x its largest "
            "|value| (see the agreement section); its time is left out")


def _replay_differs(replay, eager: list) -> str | None:
    """Why a decode step's CUDA-graph replay is not the step it times, if it is not: replayed
    once, every layer's output against the one it computed eagerly. The agreement check sees
    layer 0's eager output only; a replay over freed tensors (session 29: the paged peer's block
    tables, whose replays read other tensors' bytes as page indices) gave wrong layers and
    impossible bandwidth."""
    outs = replay.outputs if isinstance(replay.outputs, list) else [replay.outputs]
    for o in outs:
        o.fill_(float("nan"))
    replay()
    if outs and outs[0].is_cuda:
        torch.cuda.synchronize()
    for i, (o, (e,)) in enumerate(zip(outs, eager)):
        diff = _max_diff((o,), (e,))
        if diff is None or _wrong(diff, (e,)):
            return (f"wrong result: its CUDA graph replay differs from its eager run (layer {i}: "
                    f"max |diff| {diff}); its time is left out")
    return None


def _error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


ROUNDS = 4  # a cell's peers are timed in this many rounds, there and back (measure_together)


def _prepare(case: Case, peer: Peer, inp: Inputs, device: str, graph: bool,
             more: tuple = ()) -> tuple[dict, object, object]:
    """(row, what to time or None, what it computed). A memory cell's peak is measured here;
    a timed cell's callable is made in the peer's context (compiled, run once, captured as a
    CUDA graph for decode). more: further layers' inputs (decode): the timed step runs the case
    on inp and on each of them (same shapes, distinct memory), and the row's time is per layer.
    A peer that cannot run gets its reason (skipped) or its error in the row, and None."""
    row = {**case.to_dict(), "peer": peer.name}
    why = peer.why_not(case, device)
    if why is None and case.section == "memory" and device != "cuda":
        why = "peak memory is measured on CUDA only"
    if why:
        row["skipped"] = why
        return row, None, None
    try:
        with peer.context(case):
            fn = peer.prepare(case, inp)
            if getattr(fn, "note", None):
                row["note"] = fn.note
            if case.section == "memory":
                xs = [t.detach().requires_grad_() for t in inp.tensors]
                do = torch.randn_like(xs[0])  # outputs have q's shape
                def step():
                    return torch.autograd.grad(fn(*xs), xs, do)
                step()  # compiles (flex, Triton) and their workspaces stay out of the peak
                row["peak_mib"] = peak_mib(step, device)
                return row, None, None
            call, out = _timed(case, fn, inp)
            eager = [out]
            if more:
                timed = [_timed(case, peer.prepare(case, m), m) for m in more]
                calls = [call] + [c for c, _ in timed]
                eager += [o for _, o in timed]
                row["layers"] = len(calls)

                def call():
                    return [c() for c in calls]
            call, note = timed_form(call, device, graph and case.section == "decode")
            if note:
                row["timing"] = note
            why = _replay_differs(call, eager) if note == "cuda graph" and case.mode == "fwd" \
                else None
            if why:
                row["error"] = why
                return row, None, None
            return row, call, out
    except Exception as e:  # noqa: BLE001 -- a peer that fails is a cell, not a crash
        _failed(row, e, case)
        # what raised may keep its exception (Inductor keeps a failed compile's), and with it
        # every frame on the stack then: this one and the callers' (time_cell's). Their locals
        # must not hold the cell's caches and graphs (session 30: Flex's failed compile at GQA
        # B=64 32k kept 16 GiB of caches and 32 GiB of graph pools past the cell, and the next
        # cell's inputs ran out of memory)
        traceback.clear_frames(e.__traceback__)
        inp = more = fn = call = out = eager = calls = timed = None  # noqa: F841
        return row, None, None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def _failed(row: dict, e: BaseException, case: Case) -> None:
    if isinstance(e, Unavailable):
        row["skipped"] = str(e)
    elif isinstance(e, torch.cuda.OutOfMemoryError):
        if case.section == "memory":
            row["peak_mib"] = "OOM"
        else:
            row["error"] = "out of memory"
    else:
        row["error"] = _error(e)


def time_cell(case: Case, peers: list[Peer], inp: Inputs, device: str, budget_ms: float,
              graph: bool, more: tuple = (), rounds: int = ROUNDS) -> list[dict]:
    """One row per peer: each peer's callable made, then all of them timed together
    (measure_together: rounds there and back, so the GPU's drift through the cell hits them
    alike), each result compared with flashtune's (a wrong answer's time is left out)."""
    prepared = [_prepare(case, p, inp, device, graph, more) for p in peers]
    timed = [(k, call) for k, (_, call, _) in enumerate(prepared) if call is not None]
    got = measure_together([call for _, call in timed], device, budget_ms=budget_ms,
                           rounds=rounds, contexts=[
                               (lambda p=peers[k]: p.context(case)) for k, _ in timed])
    ref = next((out for p, (_, _, out) in zip(peers, prepared)
                if p.name == OURS and out is not None), None)
    for (k, _), res in zip(timed, got):
        row, _, out = prepared[k]
        if isinstance(res, BaseException):
            _failed(row, res, case)
            continue
        ms, spread = res
        if "layers" in row:
            ms /= row["layers"]
        note = f"spread {spread:.3f}" if device == "cuda" else "cpu wall clock"
        if device == "cuda" and rounds > 1:
            note = f"{rounds} rounds with the other peers; " + note
        row.update(ms=ms, throughput=case.work() / (ms * 1e-3) / _SCALE[case.unit],
                   timing=(row["timing"] + "; " + note) if row.get("timing") else note)
        diff = None if ref is None or peers[k].name == OURS else _max_diff(out, ref)
        if diff is not None:
            row["max_abs_diff"] = diff  # of the output (fwd) or the gradients
            wrong = _wrong(diff, ref)
            if wrong:  # a time for another answer is no time: out of the ratios
                row["error"] = wrong
                row["wrong_ms"] = row.pop("ms")
                row.pop("throughput")
    rows = [row for row, _, _ in prepared]
    # a peer's exception kept elsewhere may hold this frame (_prepare): nothing of the cell in it
    inp = more = prepared = timed = got = ref = out = res = _ = None  # noqa: F841
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _summary(case: Case, rows: list[dict]) -> str:
    cells = []
    for r in rows:
        if "throughput" in r:
            cells.append(f"{r['peer']} {r['throughput']:.4g}")
        elif "peak_mib" in r:
            v = r["peak_mib"]
            cells.append(f"{r['peer']} {v if isinstance(v, str) else f'{v:.0f} MiB'}")
        elif "error" in r:
            cells.append(f"{r['peer']} error")
    unit = "" if case.section == "memory" else f" ({case.unit})"
    return f"{case.label}{unit}: " + (", ".join(cells) or "nothing ran")


class ResumeMismatch(ValueError):
    """--resume got another device's result."""


def _layers(case: Case, inp: Inputs, device: str, layers: int, max_bytes: float) -> tuple:
    """The inputs of layers 2..L of a decode step (seeds 1..L-1), as many as fit max_bytes of
    caches in all and the device's memory; () for other sections. As a server lays a step out:
    each layer its own q and caches, one lengths tensor (layer 1's) for all of them (the paged
    peer's block table too: Paged). The paged render read 1.03-1.14x contiguous at MQA B=1 32k
    with the lengths shared this way, 1.02-1.05x with one a layer (H100, docs/benchmarks.md
    session 47, a probe's steps), so the layout a server has is the one timed."""
    if case.section != "decode" or layers <= 1:
        return ()
    each = sum(t.numel() * t.element_size() for t in inp.tensors[1:])
    more = []
    for i in range(1, min(layers, max(1, int(max_bytes // max(each, 1))))):
        try:
            layer = make_inputs(case, device, seed=i)
        except torch.cuda.OutOfMemoryError:
            break
        more.append(Inputs(layer.tensors, {**layer.extra, "cache_seqlens":
                                           inp.extra["cache_seqlens"]}))
    return tuple(more)


def run(shapes: grid.Shapes, sections, peers: list[Peer], device: str, *, quick: bool = False,
        budget_ms: float = 60.0, graph: bool = True, progress: str = "auto",
        stream=None, checkpoint=None, command: str | None = None,
        resume: dict | None = None, decode_layers: int = 1,
        decode_max_gib: float = 20.0) -> dict:
    """The whole benchmark; returns the result document (report.py renders it). checkpoint: a
    path the document so far is written to after every case ("partial": true), so that a run
    cut short (a time limit) still leaves its rows for `flashtune bench --from`. resume: an
    earlier result of this device whose finished cells (a number, or a reason to skip) are
    kept instead of measured again; its failed cells run again. decode_layers: a decode cell
    times a step of that many layers, each with its own cache (at most decode_max_gib of caches
    in all), per layer -- how a server replays a step, the graph's launch shared by its layers."""
    env = environment(device)
    env["decode_layers"] = decode_layers
    if command:
        env["command"] = command
    kept = {}
    if resume:
        if resume["env"].get("device") != env["device"]:
            raise ResumeMismatch(f"cannot resume a run of {resume['env'].get('device')!r} on "
                             f"{env['device']!r}")
        kept = {(case_key(r), r["peer"]): r for r in resume["rows"]
                if "error" not in r and any(k in r for k in ("throughput", "peak_mib", "skipped"))}
    cases = grid.cases(shapes, sections)
    plan = []
    for c in cases:
        key = case_key(c.to_dict())
        ps = [p for p in peers if c.section in p.sections]
        plan.append((c, [p for p in ps if (key, p.name) not in kept],
                     [kept[(key, p.name)] for p in ps if (key, p.name) in kept]))
    bar = Progress(sum(len(ps) for _, ps, _ in plan), progress, stream)
    bar.line(f"{env['device']}, torch {env['torch']}, triton {env['triton']}: "
             f"{len(cases)} cases x {len(peers)} peers"
             + (f"; {len(kept)} cells kept from the resumed run" if kept else ""))
    ceil = ceilings(device, quick)
    bar.line(f"ceilings: {ceil['matmul']['what']} {ceil['matmul']['tflops']:.4g} TFLOP/s, "
             f"{ceil['copy']['what']} {ceil['copy']['gbps']:.4g} GB/s")
    rows = []
    doc = {"env": env, "ceilings": ceil, "peers": {p.name: p.doc for p in peers},
           "masks": {k: m.doc for k, m in grid.MASKS.items()}, "rows": rows}
    for case, case_peers, done in plan:
        rows += done
        if not case_peers:
            continue
        try:
            inp = make_inputs(case, device)
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory for the inputs
            for p in case_peers:
                rows.append({**case.to_dict(), "peer": p.name, "error": f"inputs: {_error(e)}"})
                bar.step(case.label)
            bar.line(f"{case.label}: inputs failed: {_error(e)}")
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        more = _layers(case, inp, device, decode_layers, decode_max_gib * 2**30)
        mine = time_cell(case, case_peers, inp, device, budget_ms, graph, more)
        for peer in case_peers:
            bar.step(f"{case.label} {peer.name}")
        rows += mine
        bar.line(_summary(case, done + mine))
        del inp, more
        if device == "cuda":
            # a cell's graphs, caches and outputs go before the next cell's inputs are made, also
            # where something the cell left in a reference cycle still holds them
            gc.collect()
            torch.cuda.empty_cache()
        if checkpoint is not None:
            write_json({**doc, "partial": True}, checkpoint)
    bar.close()
    return doc
