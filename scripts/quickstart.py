"""Run the quickstart DAG locally through ``dag.test()`` on a sqlite AIRFLOW_HOME kept in ``.demo/`` (reset at every
run); print rank 0's result and the command that shows the run in Airflow's UI (``make ui``).

Every epoch is checkpointed under ``.demo/checkpoints`` ([torch_elastic] checkpoint_root). ``--interrupt-at N`` makes
the first try fail recoverably after epoch N: Airflow retries it, and the second try resumes after epoch N.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
# Kept after the run (reset at the next one), so that `make ui` can show this run in Airflow's UI.
home = os.environ.get("TORCHELASTIC_DEMO_HOME") or str(REPO / ".demo" / "airflow-home")
Path(home).mkdir(parents=True, exist_ok=True)
os.environ.update(
    AIRFLOW_HOME=home,
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "example_dags"),
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
)
# Local execution unless the caller chose otherwise (the DAG itself does not say: the same file runs on Kubernetes).
os.environ.setdefault("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
# Where the quickstart checkpoints each epoch; each DAG run gets its own folder under it, kept after the run.
os.environ.setdefault("AIRFLOW__TORCH_ELASTIC__CHECKPOINT_ROOT", str(REPO / ".demo" / "checkpoints"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--interrupt-at",
        type=int,
        default=-1,
        metavar="EPOCH",
        help="fail the first try recoverably after this epoch, to show the retry resuming from its checkpoint",
    )
    args = parser.parse_args(argv)
    from airflow.dag_processing.dagbag import BundleDagBag
    from airflow.utils import db

    db.resetdb()
    # As Airflow's dag-processor reads a bundle: its folder on sys.path, where a DAG file finds the modules beside it.
    bag = BundleDagBag(str(REPO / "example_dags"), bundle_path=REPO / "example_dags")
    if bag.import_errors:
        print(f"DAG import errors: {bag.import_errors}", file=sys.stderr)
        return 1
    dag = bag.get_dag("torch_elastic_quickstart")
    run = dag.test(run_conf={"interrupt_at_epoch": args.interrupt_at})
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
    tab = f"/dags/{ti.dag_id}/runs/{quote(ti.run_id, safe='')}/tasks/train/plugin/training-job"
    print("\nSee this run in Airflow's UI (the 'Training jobs' page and the task's 'Training job' tab): make ui")
    print(f"  then open http://127.0.0.1:8080/plugin/training-jobs or http://127.0.0.1:8080{tab}")
    return 0 if str(run.state) == "success" and result else 1


if __name__ == "__main__":
    raise SystemExit(main())
