"""Test session setup: a throwaway AIRFLOW_HOME with a sqlite database, set before anything imports Airflow."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Write every skip and its reason where ``TORCHELASTIC_SKIP_REPORT`` says: ``.ci/run`` fails on any skip that
    ``scripts/check_skips.py`` does not list as expected, so a tier cannot vanish from CI unnoticed."""
    target = os.environ.get("TORCHELASTIC_SKIP_REPORT")
    if not target:
        return
    import json

    lines = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        lines.append(json.dumps({"test": report.nodeid, "reason": str(reason).removeprefix("Skipped: ")}))
    Path(target).write_text("".join(f"{line}\n" for line in lines))
