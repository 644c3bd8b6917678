"""What CI (``.ci/run``) checks around the test suite, so that it cannot pass having lost a tier.

- ``python scripts/ci_guard.py env [ARG...]``, before anything is built: refuses arguments (a selection such as
  ``-k``, ``-m``, ``--deselect``, ``--lf`` or ``-x`` drops tests without skipping them, so nothing downstream would see
  them go) and the settings that drop or rewrite tests (:data:`REFUSED_ENV`, ``TORCHELASTIC_SKIP_CLUSTER``).
- ``python scripts/ci_guard.py report REPORT``, after pytest: fails when REPORT is missing (pytest did not get as far
  as writing it), when a test was skipped for a reason not in :data:`EXPECTED_SKIPS`, or when a tier ran fewer tests
  than its minimum in :data:`MINIMUMS`, or ran tests in a tier the table does not know.
- ``python scripts/ci_guard.py times REPORT [STEP=SECONDS...] --total SECONDS``: the time budget ``scripts/test.sh``
  prints at its end, its steps' times and, from REPORT, the time the tests of each tier took.

REPORT is written by the pytest run itself (tests/conftest.py, where ``TORCHELASTIC_TEST_REPORT`` names it): one JSON
object per test, ``{"test": nodeid, "tier": ..., "outcome": "passed" | "failed" | "xfailed" | "skipped",
"duration": seconds}``, with ``"reason"`` when skipped. Standard library only: ``.ci/run`` runs the ``env`` check with
the system's python, before ``.venv`` exists on a clean clone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

#: Settings that change what the suite runs without any test being skipped, and why CI refuses each when non-empty.
REFUSED_ENV: Final = {
    "PYTEST_ADDOPTS": "adds pytest options: -m, -k, --deselect, --lf or -x drop tests without a skip",
    "PYTEST_PLUGINS": "loads plugins, which can deselect tests without a skip",
    "UPDATE_GOLDEN": "turns the golden-file tests into rewrites of the golden files, which always pass",
}
#: Skips the cluster, deployment and UI tiers (tests/cluster/pytest_plugin.py); "0" is its default and harmless.
SKIP_CLUSTER_ENV: Final = "TORCHELASTIC_SKIP_CLUSTER"

#: The skips CI accepts, and why each is not a gap. A skip is expected only when the machine truly cannot run the
#: test, never because a tier was switched off.
EXPECTED_SKIPS: Final = {
    # The CRD derivative is compared with the upstream file, which lies beside the repository (../shared/crds) and
    # is never committed; a clone without it cannot compare.
    r"^upstream CRD not at ": "the upstream CRDs are not beside this clone",
    # This machine has no GPU; the GPU path is checked on a lent device.
    r"^needs a CUDA device": "no CUDA device here",
}

#: The fewest tests each tier must run (pass or fail: failures are pytest's to report) for CI to pass: about 80 % of
#: what it ran when the minimum was set, so that removing a few tests needs no edit here but losing a tier, or a fifth
#: of one, fails. The tiers are tests/conftest.py's ``tier_of``. Counted on 2026-12-03 from CI's report on 2eef85e
#: (run, less the expected skips).
MINIMUMS: Final = {
    # Counts of the CI run of 2026-12-03 (2,861 tests); each minimum is about 80 % of its tier's count.
    # tests/unit: 1995 tests, one of them CUDA-only.
    "unit": 1596,
    # tests/contract: 330, 315 without ../shared/crds (the comparisons with the upstream CRDs skip then).
    "contract": 252,
    # tests/runner: 98 (real processes on CPU).
    "runner": 78,
    # tests/e2e without a cluster: 40 (DAGs run by dag.test() with local processes).
    "e2e-local": 32,
    # On the simulated kubelet (the ``cluster`` mark or ``kube_cluster``): 131.
    "cluster": 105,
    # On the real node (``real_node_cluster``, or tests/cluster_tests/test_real_node.py's own node): 46.
    "real-node": 37,
    # tests/deployment: 7 (a real Airflow deployment on PostgreSQL, on the real node).
    "deployment": 5,
    # tests/ui: 10 (the UI plugin in headless Chromium against that deployment).
    "ui": 8,
    # tests/cluster_tests that start no cluster: 204 (the test cluster's own parts, in process).
    "harness": 163,
}

#: scripts/test.sh's name for its pytest step, under which the budget shows each tier's time.
PYTEST_STEP: Final = "pytest"
#: The outcome of a test that did not run; every other outcome counts towards its tier's minimum.
SKIPPED: Final = "skipped"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestResult:
    """One line of the report."""

    __test__ = False  # not a pytest test class, whatever its name

    test: str
    tier: str
    outcome: str
    duration: float
    reason: str = ""


def refusals(environ: Mapping[str, str], args: Iterable[str]) -> list[str]:
    """Why CI must not run with these settings and arguments: one line each, empty when it may."""
    reasons = [f"{name}={environ[name]!r} {why}; unset it" for name, why in REFUSED_ENV.items() if environ.get(name)]
    skip_cluster = environ.get(SKIP_CLUSTER_ENV, "")
    if skip_cluster not in ("", "0"):
        reasons.append(
            f"{SKIP_CLUSTER_ENV}={skip_cluster} would skip the cluster, deployment and UI tiers; CI runs them all "
            "(unset it)"
        )
    given = list(args)
    if given:
        reasons.append(
            f"CI takes no arguments, got {' '.join(given)!r}: a selection (-k, -m, --deselect, --lf, -x...) drops "
            "tests without a skip; run `bash scripts/test.sh ARGS` for a narrower run"
        )
    return reasons


def read_report(path: Path) -> list[TestResult]:
    """The report's tests; raises ``FileNotFoundError`` when pytest wrote none, ``ValueError`` on a malformed line."""
    results = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            results.append(TestResult(**json.loads(line)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}:{number}: not a test line of tests/conftest.py's report ({e}): {line}") from e
    return results


def unexpected_skips(results: Iterable[TestResult]) -> list[TestResult]:
    return [
        r
        for r in results
        if r.outcome == SKIPPED and not any(re.search(pattern, r.reason) for pattern in EXPECTED_SKIPS)
    ]


def executed_per_tier(results: Iterable[TestResult]) -> Counter[str]:
    return Counter(r.tier for r in results if r.outcome != SKIPPED)


def tier_shortfalls(counts: Mapping[str, int], minimums: Mapping[str, int] = MINIMUMS) -> list[str]:
    """Each tier that ran fewer tests than its minimum, or that the table does not know: one line each."""
    short = [
        f"tier {tier!r} ran {counts.get(tier, 0)} test(s), fewer than its minimum {minimum}"
        for tier, minimum in minimums.items()
        if counts.get(tier, 0) < minimum
    ]
    unknown = sorted(set(counts) - set(minimums))
    short += [f"tier {tier!r} ran {counts[tier]} test(s) but has no minimum in MINIMUMS" for tier in unknown]
    return short


def print_summary(results: list[TestResult], counts: Mapping[str, int]) -> None:
    skipped = [r for r in results if r.outcome == SKIPPED]
    print(f"==> skipped tests: {len(skipped)}")
    for r in skipped:
        print(f"    {r.test}: {r.reason}")
    print("==> tests run per tier")
    for tier in sorted(set(MINIMUMS) | set(counts)):
        print(f"    {tier:<12} {counts.get(tier, 0):>5}  (minimum {MINIMUMS.get(tier, 'none')})")


def report_failures(results: list[TestResult], counts: Mapping[str, int]) -> list[str]:
    """Why CI fails on this report: one line each, empty when it passes."""
    failures = []
    bad = unexpected_skips(results)
    if bad:
        failures.append(
            f"{len(bad)} test(s) skipped for a reason CI does not accept (expected only: "
            + "; ".join(EXPECTED_SKIPS.values())
            + "); make the test run here, or add its reason to EXPECTED_SKIPS in scripts/ci_guard.py with why"
        )
    shortfalls = tier_shortfalls(counts)
    if shortfalls:
        failures += shortfalls
        failures.append(
            "a tier was dropped (a selection, a plugin) or lost its tests; if tests were removed or moved on purpose, "
            "change MINIMUMS in scripts/ci_guard.py (or tier_of in tests/conftest.py) and say why"
        )
    return failures


def check_report(path: Path) -> int:
    try:
        results = read_report(path)
    except FileNotFoundError:
        print(f"ci_guard: no test report at {path}: did pytest run?", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"ci_guard: {e}", file=sys.stderr)
        return 1
    counts = executed_per_tier(results)
    print_summary(results, counts)
    failures = report_failures(results, counts)
    for failure in failures:
        print(f"ci_guard: {failure}", file=sys.stderr)
    return 1 if failures else 0


def seconds_per_tier(results: Iterable[TestResult]) -> dict[str, float]:
    """The sum of each tier's tests' setup, call and teardown times (a session fixture counts for its first test)."""
    seconds: defaultdict[str, float] = defaultdict(float)
    for r in results:
        seconds[r.tier] += r.duration
    return dict(seconds)


def budget_lines(steps: Iterable[tuple[str, int]], tiers: Mapping[str, float] | None, total: int) -> list[str]:
    """The time budget's table; ``tiers`` is None when there is no report to read them from."""
    lines = ["==> time budget (seconds)"]
    for name, seconds in steps:
        if name != PYTEST_STEP:
            lines.append(f"    {name:<28} {seconds:>6}")
            continue
        lines.append(f"    {'pytest (wall time)':<28} {seconds:>6}")
        if tiers is None:
            lines.append("      (no test report: no time per tier)")
            continue
        # Each tier's tests' times added up: over two workers, together more than pytest's wall time.
        for tier in sorted(tiers, key=tiers.__getitem__, reverse=True):
            lines.append(f"      {'tests: ' + tier:<26} {tiers[tier]:>6.0f}")
    lines.append(f"    {'total':<28} {total:>6}")
    return lines


def parse_step(text: str) -> tuple[str, int]:
    name, sep, seconds = text.rpartition("=")
    if not sep or not name or not seconds.isdigit():
        raise argparse.ArgumentTypeError(f"a step is NAME=SECONDS, got {text!r}")
    return name, int(seconds)


def print_budget(path: Path, steps: list[tuple[str, int]], total: int) -> int:
    try:
        tiers: dict[str, float] | None = seconds_per_tier(read_report(path))
    except (FileNotFoundError, ValueError):
        tiers = None  # the budget is information: a missing report fails in `report`, not here
    print("\n".join(budget_lines(steps, tiers, total)))
    return 0


def check_env(environ: Mapping[str, str], args: list[str]) -> int:
    reasons = refusals(environ, args)
    for reason in reasons:
        print(f"CI: {reason}", file=sys.stderr)
    return 1 if reasons else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        # Before argparse, which would take .ci/run's arguments (-k, -m...) for options of its own and exit 2 with a
        # usage line instead of saying why CI refuses them.
        return check_env(os.environ, argv[1:])
    parser = argparse.ArgumentParser(prog="scripts/ci_guard.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="refuse settings, and .ci/run's arguments, that drop tests (before any build)")
    report = commands.add_parser("report", help="check the pytest run's report")
    report.add_argument("path", type=Path)
    times = commands.add_parser("times", help="print the time budget")
    times.add_argument("path", type=Path)
    times.add_argument("steps", nargs="*", type=parse_step, metavar="STEP=SECONDS")
    times.add_argument("--total", type=int, required=True)
    options = parser.parse_args(argv)
    if options.command == "report":
        return check_report(options.path)
    if options.command == "times":
        return print_budget(options.path, options.steps, options.total)
    raise AssertionError(f"{options.command!r}: `env` is answered before argparse, which lists it for --help only")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
