"""Each measured trial of a search's storage: bucket, variant, stage, the phases of its
measurement and notes (`result.phases`, docs/search.md) -- what a device call prints after a
short search, to show where a trial's time went.

    python3 bench/trial_phases.py /tmp/search.journal
    python3 bench/trial_phases.py --failed /tmp/search.journal   # the trials that did not measure
"""
from __future__ import annotations

import argparse
import statistics
from datetime import datetime

from search_scaling import trials_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage", help="journal file or storage URL")
    ap.add_argument("--failed", action="store_true",
                    help="list the trials that measured nothing (stage, reason) instead")
    a = ap.parse_args()
    if a.failed:
        for line in failed_lines(trials_of(a.storage)):
            print(line)
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


def failed_lines(trials) -> list:
    """One line per trial that failed (a stage and reason in its result: compile, gate, time,
    infeasible, a lost or busy trial), oldest first. A duplicate carries the result of the trial
    it repeats, and "measured": False with it, so that flag alone listed the duplicates of good
    variants (with "?" for a reason) and none of the failures, which count as measured."""
    out = []
    # a trial never started has no start time: first (datetime.min, not 0: they do not compare)
    for t in sorted(trials, key=lambda t: t.datetime_start or datetime.min):
        r = t.user_attrs.get("result") or {}
        if r.get("stage") and not r.get("duplicate"):
            out.append(f"{t.user_attrs.get('variant', '')[:70]:70} {r['stage']:10} "
                       f"{(r.get('reason') or '')[:160]}")
    return out


if __name__ == "__main__":
    main()
