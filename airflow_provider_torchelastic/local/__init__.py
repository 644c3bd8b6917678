"""Local execution (``execution="local"``): the runner as subprocesses of the Airflow worker, one per node.

Never Airflow: the operator passes a line logger and maps the verdict to Airflow's exceptions.
"""

from airflow_provider_torchelastic.local.run import LocalRun, run_locally

__all__ = ["LocalRun", "run_locally"]
