"""Run the quickstart DAG locally through ``dag.test()`` on a throwaway sqlite AIRFLOW_HOME; print rank 0's result."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
home = tempfile.mkdtemp(prefix="torchelastic-quickstart-")
os.environ.update(
    AIRFLOW_HOME=home,
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "example_dags"),
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
)
# Local execution unless the caller chose otherwise (the DAG itself does not say: the same file runs on Kubernetes).
os.environ.setdefault("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")


def main() -> int:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    db.resetdb()
    bag = DagBag(str(REPO / "example_dags"))
    if bag.import_errors:
        print(f"DAG import errors: {bag.import_errors}", file=sys.stderr)
        return 1
    dag = bag.get_dag("torch_elastic_quickstart")
    run = dag.test()
    ti = next(t for t in run.get_task_instances() if t.task_id == "train")
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = (
            session.query(XComModel)
            .filter_by(dag_id=ti.dag_id, run_id=ti.run_id, task_id="train", key="return_value")
            .one_or_none()
        )
    result = XComModel.deserialize_value(row) if row is not None else None
    print(f"\nquickstart: DAG run {run.state}; rank 0's result (XCom return_value of 'train'):")
    print(json.dumps(result, indent=2))
    return 0 if str(run.state) == "success" and result else 1


if __name__ == "__main__":
    raise SystemExit(main())
