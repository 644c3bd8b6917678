"""What training code calls on the workers, never Airflow or a Kubernetes client: the run context, checkpoints and
``report()``. Their public paths are the package's (``from airflow_provider_torchelastic import context,
checkpoint, report``); these are the modules behind them.
"""
