"""Each hopper_fwd record of a table (a re-search's export, before it is merged into a shipped
table) forced on test_tables_gpu's shape -- 1000 rows, no tile divides them, GQA 4, a persistent
grid looping -- bf16 and fp16, causal and not, against the float64 reference; then each record's
runner-ups of other families (search.rival_variants: the same run's times). One line a check.

    python3 bench/force_records.py TABLE.json
"""
from __future__ import annotations

import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import torch  # noqa: E402

import flashtune  # noqa: E402
from _check import assert_matches_reference, qkv  # noqa: E402
from tuned_db.io import read_table  # noqa: E402


def main(path: str) -> int:
    table = read_table(Path(path))
    bad = 0
    for r in table.records:
        if r.bucket.family != "hopper_fwd":
            continue
        rivals = [(name, round(ms, 4)) for name, ms in r.runner_ups
                  if name.split("-")[0] != r.variant.family]
        print(f"{r.bucket.key}: {r.variant.name} {r.median_ms:.4f} ms; other families' "
              f"runner-ups {rivals or 'none'}")
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                q, k, v = qkv(4, 16, 4, 1000, 1000, r.bucket.head_dim, dtype, "cuda")
                try:
                    with flashtune.force(r.variant.name):
                        assert_matches_reference(q, k, v, causal=causal)
                    print(f"  ok {dtype} causal={causal}")
                except AssertionError as e:
                    bad += 1
                    print(f"  FAILED {dtype} causal={causal}: {str(e)[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
