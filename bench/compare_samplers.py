"""Replay recorded exhaustive sweeps and compare samplers: how many measured trials each needs
to get within 2% of the exhaustive best (median and worst over seeds), as a markdown table.

    python3 bench/compare_samplers.py search_spaces/sweeps/sweep-h100.jsonl --seeds 20
    python3 bench/compare_samplers.py --synthetic          # no recording: a made-up landscape

Runs on the CPU in a minute or so; buckets a sweep did not finish are skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def complete_problems(path: str):
    from flashtune.replay import read_recording
    from flashtune.search_study import bucket_label
    from flashtune.problem import Bucket

    done = {}
    for line in open(path):
        d = json.loads(line)
        if d.get("kind") == "bucket_end":
            done[d["bucket"]] = d.get("complete", False)
    return [p for p in read_recording(path)[2].values()
            if done.get(bucket_label(Bucket.of(p)), True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="*")
    ap.add_argument("--samplers", default="tpe,cmaes,random,grid")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--within", type=float, default=0.02)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)

    from flashtune import targets
    from flashtune.sampler_eval import compare, synthesize, table
    from flashtune.search_plan import standard_problem

    paths = list(a.recordings)
    if a.synthetic:
        path = Path(tempfile.mkdtemp()) / "synthetic.jsonl"
        synthesize(path, targets.get("H100"),
                   [standard_problem("fwd", "bfloat16", 128, c, 4096) for c in (False, True)])
        paths.append(str(path))
    samplers = tuple(s for s in a.samplers.split(",") if s)
    try:
        import cmaes  # noqa: F401
    except ImportError:
        samplers = tuple(s for s in samplers if s != "cmaes")
        print("(cmaes is not installed: skipping the CMA-ES sampler)", file=sys.stderr)
    rows = []
    for p in paths:
        rows += compare(p, complete_problems(p), samplers=samplers, seeds=range(a.seeds),
                        within=a.within)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
