"""The operator's extra links (a dashboard, a log system), built from the job the task pushed to XCom."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from airflow.sdk import BaseOperator, BaseOperatorLink

from airflow_provider_torchelastic.core.public import OPERATORS_MODULE, publish
from airflow_provider_torchelastic.settings import url_template

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

__all__ = ["XCOM_JOB_KIND", "XCOM_JOB_NAME", "XCOM_JOB_NAMESPACE", "TorchElasticJobLink", "TorchElasticLogsLink"]

#: XCom keys pushed before deferring (extra links read them, so they survive deferral).
XCOM_JOB_NAME: Final = "job_name"
XCOM_JOB_NAMESPACE: Final = "job_namespace"
XCOM_JOB_KIND: Final = "job_kind"


def _link_from_template(template: str, ti_key: TaskInstanceKey) -> str:
    from airflow.sdk.execution_time.xcom import XCom

    if not template:
        return ""
    name = XCom.get_value(key=XCOM_JOB_NAME, ti_key=ti_key)
    namespace = XCom.get_value(key=XCOM_JOB_NAMESPACE, ti_key=ti_key)
    kind = XCom.get_value(key=XCOM_JOB_KIND, ti_key=ti_key)
    if not name:
        return ""
    return str(template).format(name=name, namespace=namespace, kind=kind or "PyTorchJob")


class TorchElasticJobLink(BaseOperatorLink):
    """The job in a dashboard: ``[torch_elastic] dashboard_url_template`` with {namespace}, {name}, {kind}."""

    name = "Training job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _link_from_template(url_template("dashboard_url_template"), ti_key)


class TorchElasticLogsLink(BaseOperatorLink):
    """The job's pod logs in a log system: ``[torch_elastic] logs_url_template`` with {namespace}, {name}, {kind}."""

    name = "Training logs"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return _link_from_template(url_template("logs_url_template"), ti_key)


# A serialized DAG names its operator's links by classpath, and a DAG serialized before this module existed is read
# after an upgrade: the written classpath stays the public one (tests/unit/test_public_surface.py pins it).
publish(TorchElasticJobLink, TorchElasticLogsLink, module=OPERATORS_MODULE)
