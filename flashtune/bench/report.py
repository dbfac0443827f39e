"""The result document of `flashtune bench` -> markdown tables, CSV and JSON.

Each table is one section and mode: a row per case, a column per peer (its throughput in the
case's unit, or peak MiB in the memory table), then flashtune's ratio to every other peer and
its share of the ceiling measured in the same run (matmul for TFLOP/s, copy for GB/s). The last
row holds the geometric means of the ratios. A peer that never ran in a table has no column;
the "Not run" list says why, and every error is listed with the cases it hit.
"""
from __future__ import annotations

import collections
import csv
import json
import math
from collections import OrderedDict
from pathlib import Path

OURS = "flashtune"
_CASE_FIELDS = ("section", "mode", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k",
                "head_dim", "causal", "dtype", "mask")
# (section, its tables as (mode or None for all, title))
_LAYOUT = (("dense", (("fwd", "Dense forward"), ("bwd", "Dense backward"),
                      ("fwd+bwd", "Dense forward + backward"))),
           ("decode", ((None, "Decoding (one query token over a KV cache)"),)),
           ("varlen", ((None, "Variable-length batches"),)),
           ("masks", ((None, "Masks"),)),
           ("memory", ((None, "Memory: peak of forward + backward"),)),
           ("bnhd", (("fwd", "Dense forward, q/k/v in (B, N, H, D) memory"),
                     ("bwd", "Dense backward, q/k/v in (B, N, H, D) memory"),
                     ("fwd+bwd", "Dense forward + backward, q/k/v in (B, N, H, D) memory"))))


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def case_key(row: dict) -> tuple:
    return tuple(row.get(f) for f in _CASE_FIELDS) + (tuple(row.get("lengths") or ()),)


def cases(rows: list[dict]) -> "OrderedDict[tuple, dict]":
    """Rows grouped by case, in run order: {case key: {peer: row}}."""
    out: OrderedDict = OrderedDict()
    for r in rows:
        out.setdefault(case_key(r), {})[r["peer"]] = r
    return out


def ratio(case_rows: dict, peer: str, ours: str = OURS) -> float | None:
    """ours / peer in throughput, where both ran."""
    a, b = case_rows.get(ours, {}).get("throughput"), case_rows.get(peer, {}).get("throughput")
    return a / b if a and b else None


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2g}%"


# a cell whose samples spread more than this (p80 / p20 - 1, timing.summary) is marked: the peers
# spread 0.01-0.1 on the H100; session 24's flashtune fwd+bwd cells at 0.3-4.4, where host
# time outlasting the L2 flush before each sample is the suspect
SPREAD_MARK = 0.25
MARK = "†"


def spread(row: dict | None) -> float | None:
    """The relative spread of a row's samples, read from its timing note (None: not noted)."""
    timing = (row or {}).get("timing", "")
    if "spread " not in timing:
        return None
    try:
        return float(timing.split("spread ")[1].split()[0].rstrip(";,"))
    except ValueError:
        return None


def _cell(row: dict | None, field: str) -> str:
    if row is None:
        return ""
    if field in row:
        wide = field == "throughput" and (spread(row) or 0.0) > SPREAD_MARK
        return _num(row[field]) + (MARK if wide else "")
    return "err" if "error" in row else "n/a"


def _md(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _describe(key: tuple, section: str) -> list[str]:
    r = dict(zip(_CASE_FIELDS, key))
    lengths = key[-1]
    c = "yes" if r["causal"] else "no"
    if section in ("dense", "bnhd"):
        return [str(r["head_dim"]), c, str(r["seqlen_q"]), f"{r['batch']}x{r['heads']}"]
    if section == "decode":
        return [f"{r['heads']}/{r['kv_heads']}", str(r["batch"]), str(r["seqlen_k"])]
    if section == "varlen":
        return [r["mode"], c, f"{len(lengths)} seqs, {sum(lengths)} tokens "
                              f"({min(lengths)}..{max(lengths)})"]
    if section == "masks":
        return [r["mask"], r["mode"], c, str(r["seqlen_q"]), f"{r['batch']}x{r['heads']}"]
    return [str(r["seqlen_q"]), f"{r['batch']}x{r['heads']}", str(r["head_dim"])]


_KEY_HEAD = {"dense": ["D", "causal", "N", "BxH"], "decode": ["Hq/Hk", "B", "Nk"],
             "varlen": ["pass", "causal", "batch"], "masks": ["mask", "pass", "causal", "N", "BxH"],
             "memory": ["N", "BxH", "D"], "bnhd": ["D", "causal", "N", "BxH"]}


def table(doc: dict, section: str, mode: str | None = None) -> str:
    """One markdown table (empty string: no rows)."""
    groups = [(k, v) for k, v in cases(doc["rows"]).items()
              if k[0] == section and (mode is None or k[1] == mode)]
    if not groups:
        return ""
    field = "peak_mib" if section == "memory" else "throughput"
    order = list(doc.get("peers") or {})
    seen = {p for _, v in groups for p in v}
    peers = [p for p in order if p in seen] + sorted(seen - set(order))
    peers = [p for p in peers if any(field in v.get(p, {}) for _, v in groups)]
    others = [p for p in peers if p != OURS] if field == "throughput" else []
    unit = groups[0][1][next(iter(groups[0][1]))].get("unit", "")
    ceil_name, ceil = ("copy", "gbps") if unit == "GB/s" else ("matmul", "tflops")
    ceiling = (doc.get("ceilings") or {}).get(ceil_name, {}).get(ceil)
    head = _KEY_HEAD[section] + peers + [f"vs {p}" for p in others]
    if field == "throughput" and ceiling:
        head.append(f"% {ceil_name}")
    body, rel = [], {p: [] for p in others}
    for key, by_peer in groups:
        line = _describe(key, section) + [_cell(by_peer.get(p), field) for p in peers]
        for p in others:
            x = ratio(by_peer, p)
            rel[p].append(x)
            line.append(f"{x:.2f}x" if x else "-")
        if field == "throughput" and ceiling:
            ours = by_peer.get(OURS, {}).get("throughput")
            line.append(_pct(ours / ceiling) if ours else "-")
        body.append(line)
    if others:
        g = [geomean(rel[p]) for p in others]
        body.append(["**geomean**"] + [""] * (len(_KEY_HEAD[section]) - 1 + len(peers))
                    + [f"**{x:.2f}x**" if x else "-" for x in g]
                    + ([""] if ceiling else []))
    what = "peak MiB above the inputs" if section == "memory" else unit
    return f"({what})\n\n" + _md(head, body)


def agreement(doc: dict) -> str:
    """Per peer, per section: the largest max_abs_diff against flashtune's result."""
    worst: OrderedDict = OrderedDict()
    for r in doc["rows"]:
        if r.get("max_abs_diff") is not None:
            k = (r["peer"], r["section"])
            worst[k] = max(worst.get(k, 0.0), r["max_abs_diff"])
    return "\n".join(f"- {peer}, {section}: {x:.3g}" for (peer, section), x in worst.items())


def not_run(doc: dict) -> str:
    """Why cells are empty or differ: caveats of cells that ran, skipped peers (reason, count)
    and errors (message, cases)."""
    skipped: OrderedDict = OrderedDict()
    errors: OrderedDict = OrderedDict()
    for r in doc["rows"]:
        if "skipped" in r:
            skipped.setdefault((r["peer"], r["skipped"]), []).append(r)
        elif "error" in r:
            errors.setdefault((r["peer"], r["error"]), []).append(r)
    notes: OrderedDict = OrderedDict()
    for r in doc["rows"]:
        if r.get("note") and "skipped" not in r and "error" not in r:
            notes.setdefault((r["peer"], r["note"]), []).append(r)
    lines = [f"- {peer} ran with a caveat: {note} ({len(rs)} cells)"
             for (peer, note), rs in notes.items()]
    for (peer, why), rs in skipped.items():
        lines.append(f"- {peer}: {why} ({len(rs)} cells)")
    for (peer, err), rs in errors.items():
        where = ", ".join(sorted({_label(r) for r in rs})[:3])
        more = f" and {len(rs) - 3} more" if len(rs) > 3 else ""
        lines.append(f"- {peer} **failed**: `{err}` ({len(rs)} cells: {where}{more})")
    wide = [r for r in doc["rows"] if "throughput" in r and (spread(r) or 0.0) > SPREAD_MARK]
    if wide:
        by_peer = collections.Counter(r["peer"] for r in wide)
        lines.append(f"- {MARK} marks a time whose samples spread more than "
                     f"{100 * SPREAD_MARK:.0f}% (p80 / p20 - 1): host time or a clock change "
                     "in the timed region, re-time before reading it ("
                     + ", ".join(f"{p}: {n} cells" for p, n in by_peer.items()) + ")")
    return "\n".join(lines)


def _label(r: dict) -> str:
    c = " causal" if r.get("causal") else ""
    extra = f" {r['mask']}" if r.get("mask") else ""
    return f"{r['section']}{extra} {r['mode']} D={r['head_dim']} N={r['seqlen_k']}{c}"


def header(doc: dict) -> str:
    e = doc["env"]
    dev = e.get("device", "?")
    if e.get("sm_count"):
        dev += f" ({e['sm_count']} SMs, sm_{e.get('capability', '').replace('.', '')})"
    lines = [f"- Device: {dev}" + (f", driver {e['driver']}" if e.get("driver") else "")
             + (f", CUDA {e['cuda']}" if e.get("cuda") else ""),
             f"- torch {e.get('torch')}, triton {e.get('triton')}, flashtune "
             f"{e.get('flashtune')}, Python {e.get('python')}; {e.get('date')}"]
    if e.get("note"):
        lines.append(f"- Note: {e['note']}")
    if doc.get("partial"):
        lines.append("- **Partial run**: cut short; the cases it finished")
    if e.get("command"):
        lines.append(f"- Reproduce: `{e['command']}`")
    c = doc.get("ceilings") or {}
    if c:
        lines.append(f"- Ceilings measured in the same run: {c['matmul']['what']} "
                     f"{_num(c['matmul']['tflops'])} TFLOP/s; {c['copy']['what']} "
                     f"{_num(c['copy']['gbps'])} GB/s")
    lines.append("- Peers: " + "; ".join(f"**{k}** {v}" for k, v in doc.get("peers", {}).items()))
    if doc.get("masks"):
        lines.append("- Masks: " + "; ".join(f"**{k}** {v}" for k, v in doc["masks"].items()))
    lines.append("- Units: TFLOP/s = 4*B*H*Nq*Nk*D per forward, halved for causal (masks: the "
                 "pairs they keep), 2.5x for the backward, 3.5x forward+backward; decoding GB/s "
                 "= bytes of K and V read once. Medians, L2 flushed before each run; `vs X` = "
                 "flashtune / X.")
    layers = doc["env"].get("decode_layers", 1)
    if layers > 1:
        lines.append(f"- Decoding: each cell times a step of {layers} layers (each its own cache, "
                     "fewer where the caches pass 20 GiB), per layer, for every peer alike")
    return "\n".join(lines)


def markdown(doc: dict, plots: dict | None = None, title: str = "flashtune bench") -> str:
    """The whole report. plots: {section: image path relative to the markdown file}."""
    plots = plots or {}
    parts = [f"# {title}: {doc['env'].get('device', '?')}", header(doc)]
    for section, tables in _LAYOUT:
        for mode, name in tables:
            t = table(doc, section, mode)
            if t:
                parts.append(f"## {name}\n\n{t}")
        if section in plots:
            parts.append(f"![{section}]({plots[section]})")
    agree = agreement(doc)
    if agree:
        parts.append(f"## Agreement with flashtune\n\nLargest |difference| from flashtune's "
                     f"output (fwd) or gradients (bwd) over the cells both ran:\n\n{agree}")
    nr = not_run(doc)
    if nr:
        parts.append(f"## Not run, caveats, failures\n\n{nr}")
    if plots.get("note"):
        parts.append(f"_{plots['note']}_")
    return "\n\n".join(parts) + "\n"


CSV_FIELDS = ("section", "mode", "peer", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k",
              "head_dim", "causal", "dtype", "mask", "lengths", "unit", "work", "ms",
              "throughput", "peak_mib", "max_abs_diff", "timing", "note", "skipped", "error")


def write_csv(doc: dict, path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in doc["rows"]:
            w.writerow({**r, "lengths": " ".join(map(str, r.get("lengths") or ()))})


def write_json(doc: dict, path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read_json(path) -> dict:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "rows" not in doc or "env" not in doc:
        raise ValueError(f"{path} is not a `flashtune bench` result (no 'env' and 'rows')")
    return doc


def merge(docs: list[dict], whole_cases: bool = False) -> dict:
    """Several runs of one device (e.g. one section each, to fit a time limit) as one document:
    rows in order, a later run's cell replacing an earlier one of the same case and peer; the
    first run's environment and ceilings, every run's command once. whole_cases: a later run's case
    replaces every row the earlier runs hold of it, the peers it did not time included, so no
    ratio of the report compares two runs. A case keeps the place it first had (a re-run
    D=64 row stays above D=128's)."""
    devices = {d["env"].get("device") for d in docs}
    if len(devices) > 1:
        raise ValueError("results of different devices cannot share tables: "
                         f"{sorted(map(str, devices))}")
    out = {**docs[0], "env": dict(docs[0]["env"]), "peers": {}, "masks": {}}
    cells: OrderedDict = OrderedDict()
    place: dict = {}  # case -> where it first appeared
    commands = []
    for d in docs:
        out["peers"].update(d.get("peers", {}))
        out["masks"].update(d.get("masks", {}))
        # a merged run's command is its runs' commands "; "-joined: each kept once
        for c in (d["env"].get("command") or "").split("; "):
            if c and c not in commands:
                commands.append(c)
        if whole_cases:
            fresh = {case_key(r) for r in d["rows"]}
            for key in [k for k in cells if k[0] in fresh]:
                del cells[key]
        for r in d["rows"]:
            place.setdefault(case_key(r), len(place))
            cells[(case_key(r), r["peer"])] = r
    out["rows"] = sorted(cells.values(), key=lambda r: place[case_key(r)])
    if commands:
        out["env"]["command"] = "; ".join(commands)
    return out
