"""Each measured trial of a search's storage: bucket, variant, stage, the phases of its
measurement and notes (`result.phases`, docs/search.md) -- what a device call prints after a
short search, to show where a trial's time went.

    python3 bench/trial_phases.py /tmp/search.journal
    python3 bench/trial_phases.py --failed /tmp/search.journal   # the trials that did not measure
"""
from __future__ import annotations

import argparse
import statistics

from search_scaling import trials_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage", help="journal file or storage URL")
    ap.add_argument("--failed", action="store_true",
                    help="list the trials that measured nothing (stage, reason) instead")
    a = ap.parse_args()
    if a.failed:
        for t in sorted(trials_of(a.storage), key=lambda t: t.datetime_start or 0):
            r = t.user_attrs.get("result") or {}
            if r and not r.get("measured", True):
                print(f"{t.user_attrs.get('variant', '')[:70]:70} {r.get('stage', '?'):10} "
                      f"{(r.get('reason') or '')[:160]}")
        return
    first = []
    for t in sorted(trials_of(a.storage), key=lambda t: t.datetime_start or 0):
        r = t.user_attrs.get("result") or {}
        ph = r.get("phases") or {}
        if not ph:
            continue
        fc = ph.get("first_call", float("nan"))
        first.append(fc)
        print(f"{t.user_attrs.get('variant', '')[:52]:52} {r.get('stage', 'ok'):8} compile "
              f"{ph.get('compile', 0):5.2f} first_call {fc:5.2f} timing {ph.get('timing', 0):5.2f} "
              f"{(r.get('notes') or r.get('reason') or '')[:70]}")
    ok = [f for f in first if f == f]
    if ok:
        print(f"{len(ok)} measured: first call median {statistics.median(ok):.3f} s, max "
              f"{max(ok):.3f} s; {sum(f > 0.5 for f in ok)} over 0.5 s (compiled again)")


if __name__ == "__main__":
    main()
