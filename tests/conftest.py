"""Test session setup: a throwaway AIRFLOW_HOME with a sqlite database, set before anything imports Airflow."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_DAGS = REPO_ROOT / "tests" / "dags"

#: Settings of the machine the suite runs on that would change what Airflow, the Kubernetes clients or torch do: an
#: ``AIRFLOW_CONN_KUBERNETES_DEFAULT`` read beside a test's own config, a ``KUBECONFIG`` or in-cluster service host
#: the hooks would fall back to, a ``RANK``/``MASTER_ADDR`` a runner would join. Cleared before anything reads
#: them; a test that needs one sets it (monkeypatch).
_AMBIENT_PREFIXES = ("AIRFLOW_", "AIRFLOW__", "KUBERNETES_", "PET_", "TORCHELASTIC_CONTEXT")
_AMBIENT_NAMES = frozenset(
    {"KUBECONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"}
)
for _name in [n for n in os.environ if n in _AMBIENT_NAMES or n.startswith(_AMBIENT_PREFIXES)]:
    del os.environ[_name]

_home = tempfile.mkdtemp(prefix="torchelastic-airflow-home-")
atexit.register(shutil.rmtree, _home, ignore_errors=True)  # one per pytest process: left behind, they pile up in /tmp
os.environ.update(
    AIRFLOW_HOME=_home,
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__UNIT_TEST_MODE="True",
    AIRFLOW__CORE__DAGS_FOLDER=str(TEST_DAGS),
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{_home}/airflow.db",
    # dag.test() runs a trigger in the worker's own process: there is no scheduler whose late processing of the
    # deferral the hold guards against, so it would only slow the tests down. The Airflow deployment tier
    # (tests/airflow_services, a real scheduler) keeps the default, and one test sets the hold itself.
    AIRFLOW__TORCH_ELASTIC__EARLY_EVENT_HOLD="0",
    # The local cluster serves both PyTorchJob and TrainJob, where `auto` would make every fixed-size multi-node
    # task a TrainJob: the tests of the PyTorchJob say so, and the TrainJob tests ask for theirs (job_kind=).
    AIRFLOW__TORCH_ELASTIC__JOB_KIND="pytorchjob",
)

if (REPO_ROOT / "tests" / "cluster" / "pytest_plugin.py").exists():
    pytest_plugins = ["tests.cluster.pytest_plugin"]


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[None]:
    """A fresh Airflow metadata database for tests that run DAGs."""
    from airflow.utils import db

    db.resetdb()
    yield


#: Session fixtures shared by every test that uses them in one pytest worker: the real-node cluster
#: (tests/cluster/pytest_plugin.py: kubelet, scheduler, controller-manager, containerd) and the one Airflow deployment
#: (tests/airflow_services), which runs its DAGs on that node. Each starts once and stops after its last test. The
#: simulated local cluster (``kube_cluster``) is not shared that way: each worker that runs a cluster test starts its
#: own (about 15 s), so that those tests, most of the suite's time and mostly waiting on pods, spread over both workers
#: instead of queueing on one.
DEPLOYMENT_FIXTURE = "airflow_services"
REAL_NODE_FIXTURE = "real_node_cluster"


def _join_group(item: pytest.Item, group: str) -> None:
    """Give ``item`` the ``@group`` suffix by which ``--dist loadgroup`` keeps a group on one worker.

    pytest-xdist 3.8 adds it itself from the ``xdist_group`` mark, but by setting ``Node._nodeid``, which pytest 9.2
    no longer reads (a node's id is ``Node._id`` there): without this, the groups would be silently ignored.
    """
    suffix = f"@{group}"
    if item.nodeid.endswith(suffix):
        return
    try:
        from _pytest.nodeid import coerce_node_id  # pytest >= 9.2
    except ImportError:  # pragma: no cover - older pytest, where xdist's own suffix works
        return
    item._id = coerce_node_id(item.nodeid + suffix)  # type: ignore[attr-defined]


def _uses(item: pytest.Item | None, fixture: str) -> bool:
    return item is not None and fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of the real node run one after the other, the deployment's last among them, so that each of the two
    can stop after its last test (:func:`pytest_runtest_teardown`): they move to where the first of them is. Under
    pytest-xdist (``-n 2 --dist loadgroup``, scripts/test.sh) they also form one group: one worker runs them (xdist
    hands out the largest group first), while the other worker takes the rest, and both share what is left."""
    node_tests = [item for item in items if _uses(item, REAL_NODE_FIXTURE)]
    if node_tests:
        first = items.index(node_tests[0])
        rest = [item for item in items if not _uses(item, REAL_NODE_FIXTURE)]
        node_tests.sort(key=lambda item: _uses(item, DEPLOYMENT_FIXTURE))  # stable: the deployment's, in order, last
        items[:] = rest[:first] + node_tests + rest[first:]
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    if node_tests:
        from tests.cluster.pytest_plugin import REAL_NODE_GROUP

        for item in node_tests:
            _join_group(item, REAL_NODE_GROUP)
    # Other tests that share one expensive fixture say so with ``pytest.mark.xdist_group(name)``, which xdist itself
    # no longer applies under pytest 9.2 (_join_group).
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and mark.args and not _uses(item, REAL_NODE_FIXTURE):
            _join_group(item, str(mark.args[0]))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the Airflow deployment, then the real node, once the last test that uses it is done rather than at the
    end of the session: idle, the deployment's scheduler, dag-processor, triggerer, api-server and PostgreSQL take
    about a tenth of a core from the tests that follow, and the node's kubelet and controllers more. (Their fixtures'
    finalizers then find nothing left to stop.)"""
    if nextitem is None:
        return  # at the end of the session the fixtures' finalizers stop them
    funcargs = getattr(item, "funcargs", {})
    services = funcargs.get(DEPLOYMENT_FIXTURE)
    if services is not None and not _uses(nextitem, DEPLOYMENT_FIXTURE):
        services.close()
        survivors = services.deployment.stop()
        assert not survivors, f"Airflow deployment processes survived teardown: {survivors}"
    node = funcargs.get(REAL_NODE_FIXTURE)
    if node is not None and not _uses(nextitem, REAL_NODE_FIXTURE):
        node.stop()


#: Where the pytest run writes its report for CI (scripts/ci_guard.py): every test with its tier, outcome and time,
#: and each skip's reason. Only the run itself writes it: ``.ci/run`` names a file that does not exist yet, so a
#: missing report says that pytest did not get there.
REPORT_ENV = "TORCHELASTIC_TEST_REPORT"
#: The report's name for a test's tier, kept on the test's reports (``user_properties``), which pytest-xdist carries
#: from the worker that ran the test to the controller that writes the report.
TIER_PROPERTY = "tier"
#: The tier of the tests of each folder under tests/ that do not use a cluster (:func:`tier_of`).
TIER_BY_DIR = {
    "unit": "unit",
    "contract": "contract",
    "runner": "runner",
    "e2e": "e2e-local",
    "cluster_tests": "harness",
    "deployment": "deployment",
    "ui": "ui",
}
#: Folders whose every test uses a cluster, yet is its own tier: the Airflow deployment, and the UI in a browser.
_OWN_TIER_DIRS = frozenset({"deployment", "ui"})


def _tests_dir(path: Path) -> str:
    """The folder under tests/ that holds ``path`` ("" for a file elsewhere)."""
    try:
        parts = path.relative_to(REPO_ROOT / "tests").parts
    except ValueError:
        return ""
    return parts[0] if len(parts) > 1 else ""


def _in_real_node_group(group: str | None) -> bool:
    """tests/cluster_tests/test_real_node.py starts a real node of its own rather than sharing the session's: it says
    so by joining the real node's group, which runs it in the worker that owns the node."""
    if group is None:
        return False
    from tests.cluster.pytest_plugin import REAL_NODE_GROUP

    return group == REAL_NODE_GROUP


def tier_of(path: Path, fixtures: Collection[str], *, cluster_mark: bool, group: str | None) -> str:
    """The tier CI counts a test in (scripts/ci_guard.py's MINIMUMS): by the folder of its file, except that a test
    that uses a cluster counts in that cluster's tier, wherever it lies. ``group`` is its ``xdist_group`` mark's."""
    folder = _tests_dir(path)
    if folder in _OWN_TIER_DIRS:
        return TIER_BY_DIR[folder]
    if REAL_NODE_FIXTURE in fixtures or _in_real_node_group(group):
        return "real-node"
    if cluster_mark or "kube_cluster" in fixtures:
        from tests.cluster.real_node import NODE_ENV

        # TORCHELASTIC_NODE=real puts the local cluster on the real node (tests/cluster/pytest_plugin.py): its tests
        # then count there, and the simulated kubelet's tier comes up short rather than passing unnoticed.
        return "real-node" if os.environ.get(NODE_ENV) == "real" else "cluster"
    return TIER_BY_DIR.get(folder, "unclassified")


def pytest_itemcollected(item: pytest.Item) -> None:
    group = item.get_closest_marker("xdist_group")
    tier = tier_of(
        item.path,
        getattr(item, "fixturenames", ()),
        cluster_mark=item.get_closest_marker("cluster") is not None,
        group=str(group.args[0]) if group is not None and group.args else None,
    )
    item.user_properties.append((TIER_PROPERTY, tier))


def _outcome(reports: list[pytest.TestReport]) -> str:
    """One outcome of a test's setup, call and teardown reports: an error in any of them fails it."""
    if any(r.failed for r in reports):
        return "failed"
    if any(r.skipped and hasattr(r, "wasxfail") for r in reports):
        return "xfailed"
    return "skipped" if any(r.skipped for r in reports) else "passed"


def _skip_reason(reports: list[pytest.TestReport]) -> str:
    report = next(r for r in reports if r.skipped)
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return str(reason).removeprefix("Skipped: ")


def _report_line(nodeid: str, reports: list[pytest.TestReport]) -> dict[str, object]:
    tiers = [value for r in reports for name, value in r.user_properties if name == TIER_PROPERTY]
    line: dict[str, object] = {
        "test": nodeid,
        "tier": tiers[0] if tiers else "unclassified",
        "outcome": _outcome(reports),
        # setup + call + teardown: a session fixture's start counts in the time of the first test that uses it.
        "duration": round(sum(r.duration for r in reports), 3),
    }
    if line["outcome"] == "skipped":
        line["reason"] = _skip_reason(reports)
    return line


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Write the report CI checks where ``TORCHELASTIC_TEST_REPORT`` says: ``.ci/run`` fails on any skip that
    ``scripts/ci_guard.py`` does not list as expected, and on a tier that ran fewer tests than its minimum, so a tier
    cannot vanish from CI unnoticed."""
    target = os.environ.get(REPORT_ENV)
    # Each pytest-xdist worker runs this hook too, with only its own tests in its stats; the controller's hold every
    # worker's reports (their user_properties included), so it alone writes.
    if not target or hasattr(config, "workerinput"):
        return
    import json

    by_test: dict[str, list[pytest.TestReport]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):  # not the warnings', deselected items nor collection errors
                by_test.setdefault(report.nodeid, []).append(report)
    lines = [_report_line(nodeid, reports) for nodeid, reports in sorted(by_test.items())]
    Path(target).write_text("".join(f"{json.dumps(line)}\n" for line in lines))
