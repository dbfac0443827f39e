"""PNG plots of a `flashtune bench` result (matplotlib, the `bench` extra): throughput against
N, one panel per pass, causality and head dim (dense) or per heads and batch (decoding), every
peer a line; peak memory against N. Without matplotlib: no plots, and a note saying so."""
from __future__ import annotations

from pathlib import Path

from .report import OURS, cases

_MODES = ("fwd", "bwd", "fwd+bwd")


def _series(groups, peer, field, x_of):
    pts = sorted((x_of(k), r[field]) for k, v in groups for p, r in v.items()
                 if p == peer and isinstance(r.get(field), (int, float)))
    return [x for x, _ in pts], [y for _, y in pts]


def _peers(doc, groups, field):
    seen = {p for _, v in groups for p, r in v.items() if isinstance(r.get(field), (int, float))}
    return [p for p in doc.get("peers", {}) if p in seen] + sorted(seen - set(doc.get("peers", {})))


def _style(doc, peers):
    """One color per peer across every plot of a report (its place in the run's peer list)."""
    import matplotlib.pyplot as plt
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = list(doc.get("peers", {}))
    order += [p for p in peers if p not in order]
    return {p: dict(color=colors[order.index(p) % len(colors)], lw=2.4 if p == OURS else 1.4,
                    marker="o", ms=3) for p in peers}


def _grid(panels, ncols):
    import matplotlib.pyplot as plt
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _dense(doc, path) -> bool:
    groups = [(k, v) for k, v in cases(doc["rows"]).items() if k[0] == "dense"]
    if not groups:
        return False
    peers = _peers(doc, groups, "throughput")
    modes = [m for m in _MODES if any(k[1] == m for k, _ in groups)]
    causals = sorted({k[8] for k, _ in groups})
    dims = sorted({k[7] for k, _ in groups})
    panels = [(m, c, d) for m in modes for c in causals for d in dims]
    fig, axes = _grid(panels, len(dims))
    style = _style(doc, peers)
    for ax, (m, c, d) in zip(axes, panels):
        sub = [(k, v) for k, v in groups if k[1] == m and k[7] == d and k[8] == c]
        _panel(ax, sub, groups, peers, style, 5, f"{m}{' causal' if c else ''}, D={d}", "N",
               "TFLOP/s")
    axes[0].legend(fontsize=7)
    _save(fig, doc, path, "dense attention")
    return True


def _panel(ax, sub, groups, peers, style, x: int, title: str, xlabel: str, ylabel: str) -> None:
    """One panel: each peer's throughput against the case key's field `x` (log2 axis)."""
    for p in peers:
        xs, ys = _series(sub, p, "throughput", lambda k: k[x])
        if xs:
            ax.plot(xs, ys, label=p, **style[p])
    _log2_axis(ax, [k[x] for k, _ in groups])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _decode(doc, path) -> bool:
    groups = [(k, v) for k, v in cases(doc["rows"]).items() if k[0] == "decode"]
    if not groups:
        return False
    peers = _peers(doc, groups, "throughput")
    panels = sorted({(k[3], k[4], k[2]) for k, _ in groups}, key=lambda t: (-t[0], t[2]))
    fig, axes = _grid(panels, min(4, len(panels)))
    style = _style(doc, peers)
    for ax, (h, hk, b) in zip(axes, panels):
        sub = [(k, v) for k, v in groups if (k[3], k[4], k[2]) == (h, hk, b)]
        _panel(ax, sub, groups, peers, style, 6, f"decode Hq/Hk={h}/{hk}, B={b}", "Nk", "GB/s")
    axes[0].legend(fontsize=7)
    _save(fig, doc, path, "decoding")
    return True


def _memory(doc, path) -> bool:
    groups = [(k, v) for k, v in cases(doc["rows"]).items() if k[0] == "memory"]
    peers = _peers(doc, groups, "peak_mib")
    if not peers:
        return False
    fig, axes = _grid([0], 1)
    style = _style(doc, peers)
    for p in peers:
        xs, ys = _series(groups, p, "peak_mib", lambda k: k[5])
        axes[0].plot(xs, ys, label=p, **style[p])
    _log2_axis(axes[0], [k[5] for k, _ in groups])
    axes[0].set_yscale("log")
    axes[0].set_xlabel("N")
    axes[0].set_ylabel("peak MiB (fwd+bwd)")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(fig, doc, path, "memory")
    return True


def _log2_axis(ax, xs):
    """N on a log scale, ticks at the measured values written out (4096, not 2^12)."""
    from matplotlib.ticker import FixedLocator, NullLocator
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                        for t in ticks], fontsize=7)


def _save(fig, doc, path, what):
    import matplotlib.pyplot as plt
    fig.suptitle(f"flashtune bench, {what}: {doc['env'].get('device', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(doc: dict, folder, prefix: str = "") -> dict:
    """{section: file name} of the PNGs written into `folder`; {"note": why} without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        return {"note": "plots skipped: matplotlib is not installed (pip install "
                        "'flashtune[bench]'; or re-render later with `flashtune bench --from`)"}
    out = {}
    for section, fn in (("dense", _dense), ("decode", _decode), ("memory", _memory)):
        name = f"{prefix}{section}.png"
        if fn(doc, Path(folder) / name):
            out[section] = name
    return out
