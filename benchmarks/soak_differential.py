"""Soak run of the randomized differential test against DDP (issue #10).

    python benchmarks/soak_differential.py --cases 500 --seed 0
    python benchmarks/soak_differential.py --seed 17 --cases 1 --world 2        # rerun one case
    python benchmarks/soak_differential.py --cases 50 --enable no_grad_anywhere  # a known-broken feature

Seeds ``seed .. seed + cases - 1`` each draw a case (model tree, data, optimizer, ZeRO settings
and, unless ``--world`` is given, the world size) with ``tests/random_models.make_case``. Cases
are run in one group of gloo ranks per world size (restarted after a failure or hang), each
compared with DDP(find_unused_parameters=True) + the same torch optimizer. Progress is printed
per case; the summary groups failures by their error and gives each failing seed's rerun command.
Exit status: 0 when every case matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import random_models as rm  # noqa: E402  (tests/ is not a package)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100, help="how many seeds to run")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--world", type=int, choices=(1, 2, 3, 4), default=None,
                        help="force this world size (default: drawn from each seed)")
    parser.add_argument("--enable", default="", help=f"comma-separated known-broken features: {','.join(rm.KNOWN_BROKEN)}")
    parser.add_argument("--case-timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--verbose", action="store_true", help="print each failure's full report as it happens")
    return parser.parse_args()


def _signature(outcome: rm.Outcome) -> str:
    """What failures have in common: the error line with numbers and addresses dropped."""
    if outcome.kind == "mismatch":
        return "mismatch: " + outcome.error.split(":", 1)[-1].split(" differs")[0].strip().split(".")[-1] + " differs"
    line = rm.first_line_of_error(outcome)
    return outcome.kind + ": " + re.sub(r"\d+", "#", line)[:160]


def main() -> int:
    args = _parse()
    features = rm.Features.with_enabled([name for name in args.enable.split(",") if name])
    cases = [rm.make_case(seed, features, world_size=args.world) for seed in range(args.seed, args.seed + args.cases)]
    by_world: dict[int, list[rm.Case]] = collections.defaultdict(list)
    for case in cases:
        by_world[case.world_size].append(case)
    start = time.monotonic()
    outcomes: list[rm.Outcome] = []

    def progress(outcome: rm.Outcome) -> None:
        outcomes.append(outcome)
        status = "ok  " if outcome.ok else outcome.kind.upper()
        detail = f"max|diff|={outcome.max_diff:.1e}" if outcome.ok else _signature(outcome)
        print(f"[{len(outcomes):4d}/{len(cases)} {time.monotonic() - start:6.0f}s] {status} seed={outcome.case.seed}"
              f" world={outcome.case.world_size} stage={outcome.case.stage} {detail}", flush=True)
        if not outcome.ok and args.verbose:
            print(outcome.report(), flush=True)

    for world in sorted(by_world):
        rm.run_cases(by_world[world], world, case_timeout_s=args.case_timeout, on_outcome=progress)

    failures = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes)} cases in {time.monotonic() - start:.0f}s: {len(outcomes) - len(failures)} matched DDP,"
          f" {len(failures)} failed", flush=True)
    counts = collections.Counter(feature for o in outcomes for feature in rm.case_features(o.case))
    print("features exercised: " + ", ".join(f"{name}={count}" for name, count in sorted(counts.items())))
    worst = max((o for o in outcomes if o.ok), key=lambda o: o.max_diff, default=None)
    if worst is not None:
        print(f"largest difference among matching cases: {worst.max_diff:.2e} at {worst.worst} (seed {worst.case.seed})")
    groups: dict[str, list[rm.Outcome]] = collections.defaultdict(list)
    for outcome in failures:
        groups[_signature(outcome)].append(outcome)
    for signature, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        print(f"\n{len(members)} x {signature}")
        for outcome in members[:5]:
            print(f"  {outcome.case.describe()}\n    rerun: {rm.rerun_command(outcome.case)}")
        if len(members) > 5:
            print(f"  ... and seeds {[o.case.seed for o in members[5:]]}")
    if failures and len(failures) <= 3:
        print("\nfull reports:")
        for outcome in failures:
            print(outcome.report())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
