"""What the distribution declares: the Airflow floor that the trigger's behaviour relies on."""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.version import Version


def test_airflow_floor_is_the_first_triggerer_that_calls_on_kill() -> None:
    # Airflow 3.3's triggerer is the first to call BaseTrigger.on_kill (mark failed / clear of a deferred task):
    # on an older one a killed deferred task would leave its job running on the cluster.
    reqs = {r.name: r for r in map(Requirement, requires("airflow-provider-torchelastic") or []) if not r.marker}
    airflow = reqs["apache-airflow"]
    assert not airflow.specifier.contains(Version("3.2.9")), airflow
    assert airflow.specifier.contains(Version("3.3.0")), airflow
    assert {"pyyaml", "tenacity"} <= set(reqs), "imported by the provider, so declared"
