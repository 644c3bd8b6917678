"""CI cannot pass having lost a tier: ``.ci/run`` refuses, before building anything, whatever would drop tests without
a skip; after the run, scripts/ci_guard.py fails on a missing report, an unexpected skip, or a tier that ran fewer
tests than its minimum; and scripts/test.sh passes on pytest's "no tests collected" as the failure it is."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import TIER_BY_DIR, tier_of

REPO = Path(__file__).resolve().parents[2]
GUARD = REPO / "scripts" / "ci_guard.py"
PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")


def load_guard() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_guard", GUARD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclass looks up its own annotations
    spec.loader.exec_module(module)
    return module


ci_guard = load_guard()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus ``extra``, without what the guard refuses (the suite may run under any of it),
    the report that the suite's own run writes, nor this worker's pytest-xdist settings."""
    dropped = {*ci_guard.REFUSED_ENV, ci_guard.SKIP_CLUSTER_ENV, "TORCHELASTIC_TEST_REPORT"}
    kept = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("PYTEST_XDIST_")}
    return {**kept, **extra}


def guard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GUARD), *args], capture_output=True, text=True, env=env or clean_env(), timeout=60
    )


# --- env: before anything is built


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PYTEST_ADDOPTS", '-m "not cluster"'),
        ("PYTEST_ADDOPTS", "-k nothing"),
        ("PYTEST_PLUGINS", "some_plugin"),
        ("UPDATE_GOLDEN", "1"),
        ("TORCHELASTIC_SKIP_CLUSTER", "1"),
    ],
)
def test_the_guard_refuses_a_setting_that_drops_tests(name: str, value: str) -> None:
    done = guard("env", env=clean_env(**{name: value}))
    assert done.returncode == 1
    assert done.stderr.startswith(f"CI: {name}=") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("args", [["-k", "nothing"], ["-m", "not cluster"], ["--deselect", "tests/unit"], ["--lf"]])
def test_the_guard_refuses_any_argument(args: list[str]) -> None:
    done = guard("env", *args)
    assert done.returncode == 1 and "CI takes no arguments" in done.stderr and " ".join(args) in done.stderr


def test_the_guard_lets_a_plain_environment_through() -> None:
    done = guard("env", env=clean_env(TORCHELASTIC_SKIP_CLUSTER="0", PYTEST_ADDOPTS=""))
    assert done.returncode == 0 and done.stderr == ""


def run_ci(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], bool]:
    """``bash .ci/run ARGS`` with a ``make`` on PATH that only notes it was reached, so that a guard that let a run
    through could never start the real build; returns the run and whether it got to make."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    marker = tmp_path / "make-was-run"
    (stubs / "make").write_text(f'#!/bin/sh\necho "$@" > {marker}\nexit 3\n')
    (stubs / "make").chmod(0o755)
    environment = clean_env(PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path), **env)
    done = subprocess.run(
        ["bash", str(REPO / ".ci" / "run"), *args],
        capture_output=True,
        text=True,
        env=environment,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    return done, marker.exists()


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["-k", "nothing"], {}, "CI takes no arguments, got '-k nothing'"),
        ([], {"PYTEST_ADDOPTS": '-m "not cluster"'}, "CI: PYTEST_ADDOPTS="),
        ([], {"UPDATE_GOLDEN": "1"}, "CI: UPDATE_GOLDEN="),
        ([], {"TORCHELASTIC_SKIP_CLUSTER": "1"}, "TORCHELASTIC_SKIP_CLUSTER=1 would skip the cluster"),
    ],
)
def test_ci_refuses_before_building_anything(tmp_path: Path, args: list[str], env: dict[str, str], says: str) -> None:
    started = time.monotonic()
    done, reached_make = run_ci(tmp_path, *args, **env)
    assert done.returncode == 1 and says in done.stderr, done.stderr
    assert not reached_make and "==>" not in done.stdout
    assert time.monotonic() - started < 30  # the guard's own time, not a build's


def test_ci_goes_on_to_make_test_when_nothing_is_refused(tmp_path: Path) -> None:
    """The control for the refusals above: the stub make is what a run reaches once the guard lets it through."""
    done, reached_make = run_ci(tmp_path)
    assert reached_make and done.returncode == 3, done.stderr
    assert (tmp_path / "make-was-run").read_text().strip() == "test"


# --- report: after the run


def line(tier: str, outcome: str = "passed", *, test: str = "", reason: str = "", duration: float = 0.5) -> str:
    fields: dict[str, object] = {"test": test or f"tests/x.py::t_{tier}", "tier": tier, "outcome": outcome}
    fields["duration"] = duration
    if reason:
        fields["reason"] = reason
    return json.dumps(fields)


def full_run(skip_tier: str = "", *extra: str) -> list[str]:
    """A report with every tier at its minimum (but ``skip_tier``'s), and ``extra`` lines."""
    lines = [
        line(tier, test=f"tests/{tier}/test_x.py::test_{n}")
        for tier, minimum in ci_guard.MINIMUMS.items()
        if tier != skip_tier
        for n in range(minimum)
    ]
    return [*lines, *extra]


def check(tmp_path: Path, lines: Iterable[str]) -> subprocess.CompletedProcess[str]:
    report = tmp_path / "report.jsonl"
    report.write_text("".join(f"{text}\n" for text in lines))
    return guard("report", str(report))


def test_a_full_run_with_expected_skips_passes_and_prints_them(tmp_path: Path) -> None:
    skips = [
        line("unit", "skipped", test="tests/unit/test_encoding.py::test_gpu", reason="needs a CUDA device"),
        line("contract", "skipped", test="tests/contract/c.py::t", reason="upstream CRD not at /x/crds/y.yaml (...)"),
    ]
    done = check(tmp_path, full_run("", *skips))
    assert done.returncode == 0, done.stderr
    assert (
        "skipped tests: 2" in done.stdout
        and "tests/unit/test_encoding.py::test_gpu: needs a CUDA device" in done.stdout
    )


def test_failed_tests_count_towards_their_tier(tmp_path: Path) -> None:
    """Failures are pytest's to report (its exit status fails CI); the guard only asks that each tier ran."""
    lines = [text.replace('"passed"', '"failed"') for text in full_run()]
    assert check(tmp_path, lines).returncode == 0


@pytest.mark.parametrize(
    "reason", ["TORCHELASTIC_SKIP_CLUSTER=1: local cluster tests skipped", "no chromium", "could not import 'x'"]
)
def test_any_other_skip_fails_ci(tmp_path: Path, reason: str) -> None:
    done = check(tmp_path, full_run("", line("ui", "skipped", test="tests/ui/test_x.py::t", reason=reason)))
    assert done.returncode == 1 and reason in done.stdout and "CI does not accept" in done.stderr


def test_a_missing_report_fails(tmp_path: Path) -> None:
    done = guard("report", str(tmp_path / "none"))
    assert done.returncode == 1 and "did pytest run" in done.stderr


def test_a_run_without_the_cluster_tier_fails(tmp_path: Path) -> None:
    """What ``-m "not cluster"`` would leave: every other tier in full, no skip, and no cluster test."""
    done = check(tmp_path, full_run("cluster"))
    assert done.returncode == 1 and "tier 'cluster' ran 0 test(s), fewer than its minimum" in done.stderr


def test_a_tier_one_short_of_its_minimum_fails_and_skips_do_not_count(tmp_path: Path) -> None:
    lines = full_run()
    index = next(i for i, text in enumerate(lines) if '"tier": "deployment"' in text)
    lines[index] = line("deployment", "skipped", test="tests/deployment/d.py::t", reason="needs a CUDA device")
    done = check(tmp_path, lines)
    assert done.returncode == 1 and "tier 'deployment' ran" in done.stderr


def test_tests_in_a_tier_without_a_minimum_fail(tmp_path: Path) -> None:
    done = check(tmp_path, full_run("", line("unclassified", test="tests/new/test_x.py::t")))
    assert done.returncode == 1 and "tier 'unclassified' ran 1 test(s) but has no minimum" in done.stderr


def test_a_line_that_is_not_a_test_fails(tmp_path: Path) -> None:
    done = check(tmp_path, full_run("", '{"test": "t", "reason": "the old skips-only line"}'))
    assert done.returncode == 1 and "report.jsonl:" in done.stderr


def test_every_tier_of_the_conftest_has_a_minimum() -> None:
    assert set(ci_guard.MINIMUMS) == {*TIER_BY_DIR.values(), "cluster", "real-node"}
    assert all(minimum >= 1 for minimum in ci_guard.MINIMUMS.values())


# --- the tier of a test (tests/conftest.py)


@pytest.mark.parametrize(
    ("path", "fixtures", "cluster_mark", "group", "tier"),
    [
        ("tests/unit/test_a.py", [], False, None, "unit"),
        ("tests/contract/test_a.py", [], False, None, "contract"),
        ("tests/runner/test_a.py", [], False, None, "runner"),
        ("tests/e2e/test_a.py", ["airflow_db"], False, None, "e2e-local"),
        ("tests/e2e/test_a.py", ["kube_cluster"], True, None, "cluster"),
        ("tests/e2e/test_a.py", ["kubernetes_default_connection", "kube_cluster"], False, None, "cluster"),
        ("tests/e2e/test_a.py", ["real_node_cluster"], True, "real-node", "real-node"),
        ("tests/cluster_tests/test_sim_kubelet.py", [], False, None, "harness"),
        ("tests/cluster_tests/test_up_down.py", ["kube_apiserver_binary"], True, None, "cluster"),
        ("tests/cluster_tests/test_real_node.py", [], True, "real-node", "real-node"),
        ("tests/deployment/test_a.py", ["airflow_services", "real_node_cluster"], True, None, "deployment"),
        ("tests/deployment/test_b.py", ["kube_cluster"], True, None, "deployment"),
        ("tests/ui/test_a.py", ["real_node_cluster"], True, None, "ui"),
        ("tests/brand_new/test_a.py", [], False, None, "unclassified"),
        ("/elsewhere/test_a.py", [], False, None, "unclassified"),
    ],
)
def test_a_tests_tier(path: str, fixtures: list[str], cluster_mark: bool, group: str | None, tier: str) -> None:
    assert tier_of(REPO / path, fixtures, cluster_mark=cluster_mark, group=group) == tier


def test_the_local_cluster_on_the_real_node_counts_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_NODE", "real")
    assert tier_of(REPO / "tests/e2e/test_a.py", ["kube_cluster"], cluster_mark=True, group=None) == "real-node"


def test_the_run_writes_one_report_with_every_workers_tests(tmp_path: Path) -> None:
    """Under pytest-xdist each worker runs the terminal summary too, with its own tests only; the report is the
    controller's, with every test once, its tier (carried from its worker) and its setup + call + teardown time."""
    (tmp_path / "test_x.py").write_text(
        "import os, time\n"
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def real_node_cluster():\n"
        "    time.sleep(0.2)\n"
        "    yield\n"
        "    time.sleep(0.2)\n\n"
        "@pytest.fixture(autouse=True)\n"
        "def note_worker():\n"
        "    with open(os.environ['WORKERS_FILE'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n"
        "def test_on_the_node(real_node_cluster): pass\n"
        "@pytest.mark.cluster\n"
        "def test_on_the_cluster(): pass\n"
        "def test_fails(): assert False\n"
        "def test_gpu(): pytest.skip('needs a CUDA device')\n"
        "@pytest.mark.parametrize('n', range(4))\n"
        "def test_more(n): pass\n"
    )
    report = tmp_path / "report.jsonl"
    workers = tmp_path / "workers"
    done = subprocess.run(
        [*PYTEST, "-p", "tests.conftest", "-n", "2", "--dist", "loadgroup", str(tmp_path / "test_x.py")],
        capture_output=True,
        text=True,
        env=clean_env(TORCHELASTIC_TEST_REPORT=str(report), WORKERS_FILE=str(workers)),
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # test_fails
    assert set(workers.read_text().split()) == {"gw0", "gw1"}
    lines = {Path(r["test"]).name: r for r in map(json.loads, report.read_text().splitlines())}
    # The real node's tests carry their xdist group in their id (tests/conftest.py's _join_group).
    node_test = "test_x.py::test_on_the_node@real-node"
    others = ["test_on_the_cluster", "test_fails", "test_gpu", *(f"test_more[{n}]" for n in range(4))]
    assert sorted(lines) == sorted([node_test, *(f"test_x.py::{name}" for name in others)])
    node, gpu = lines[node_test], lines["test_x.py::test_gpu"]
    assert (node["tier"], node["outcome"]) == ("real-node", "passed") and node["duration"] >= 0.4
    assert (gpu["outcome"], gpu["reason"]) == ("skipped", "needs a CUDA device")
    assert lines["test_x.py::test_on_the_cluster"]["tier"] == "cluster"
    assert (lines["test_x.py::test_fails"]["tier"], lines["test_x.py::test_fails"]["outcome"]) == (
        "unclassified",
        "failed",
    )


# --- scripts/test.sh


def stub_checkout(tmp_path: Path, *, failing: str = "") -> Path:
    """A checkout holding the real scripts/test.sh and ci_guard.py, whose setup, linters and type checker are stubs
    that pass (``failing``'s fails) and whose python is this one: its pytest finds no test there."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    for script in ("test.sh", "ci_guard.py"):
        shutil.copy(REPO / "scripts" / script, root / "scripts" / script)
    stubs = {
        root / "scripts" / "setup.sh": "exit 0",
        **{
            root / ".venv" / "bin" / tool: f"exit {int(tool == failing)}"
            for tool in ("ruff", "mypy", "lint-imports", "sphinx-build")
        },
        root / ".venv" / "bin" / "python": f'exec "{sys.executable}" "$@"',
    }
    for path, body in stubs.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return root


def run_test_sh(root: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env(TORCHELASTIC_SKIP_CLUSTER="1", TORCHELASTIC_TEST_WORKERS="1")  # no build, one process
    return subprocess.run(
        ["bash", str(root / "scripts" / "test.sh")], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_run_that_collects_no_test_fails_with_pytests_status_and_prints_the_budget(tmp_path: Path) -> None:
    """scripts/test.sh itself, on a checkout without tests: pytest's 5 (no tests collected) is its status."""
    done = run_test_sh(stub_checkout(tmp_path))
    assert done.returncode == 5, done.stdout + done.stderr
    budget = done.stdout[done.stdout.index("==> time budget") :]
    for row in ("setup", "ruff", "mypy", "lint-imports", "pytest (wall time)", "(no test report", "total"):
        assert row in budget, budget


def test_a_failed_step_still_prints_the_budget_so_far(tmp_path: Path) -> None:
    done = run_test_sh(stub_checkout(tmp_path, failing="mypy"))
    assert done.returncode == 1
    budget = done.stdout[done.stdout.index("==> time budget") :]
    assert "ruff" in budget and "mypy" not in budget and "pytest" not in budget and "total" in budget
