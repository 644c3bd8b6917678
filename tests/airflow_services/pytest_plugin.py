"""pytest plugin for tests that need a real Airflow deployment; load it as tests/deployment/conftest.py does.

Fixture ``airflow_services`` (session): an :class:`~tests.airflow_services.services.AirflowServices` on the real
node (``real_node_cluster``: so it is skipped with ``TORCHELASTIC_SKIP_CLUSTER=1``), whose pods run the runner image
built from docker/Dockerfile and mount the node's shared folder, where artifacts go. It is stopped after the last test
that uses it (tests/conftest.py) or at the end of the session, which also checks that no process of it survived.
Its logs stay in pytest's temporary dir (``airflow-services*/logs``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.airflow_services.deployment import Deployment
from tests.airflow_services.services import AirflowServices


@pytest.fixture(scope="session")
def airflow_services(real_node_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowServices]:
    state_dir = tmp_path_factory.mktemp("airflow-services")
    progress: list[str] = []

    def log(msg: str) -> None:
        progress.append(msg)
        if "apt-get" in msg:  # the one slow step that happens once per machine: say so outside pytest's capture
            print(f"\n[airflow_services] {msg}", file=sys.__stderr__, flush=True)

    deployment = Deployment(state_dir, log=log)
    try:
        deployment.start(
            kubeconfig=real_node_cluster.kubeconfig,
            namespace=real_node_cluster.namespace,
            image=real_node_cluster.image,
            shared_dir=real_node_cluster.shared_dir,
        )
    except Exception as e:  # PostgreSQL, migration or a process that would not start: the message says which
        pytest.fail(f"the Airflow deployment could not start: {e}\n(progress: {'; '.join(progress)})", pytrace=False)
    services = AirflowServices(deployment)
    try:
        yield services
    finally:
        services.close()
        survivors = deployment.stop()
    assert not survivors, f"Airflow deployment processes survived teardown: {survivors}"
