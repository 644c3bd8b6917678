"""A real Airflow deployment for the tests: ``airflow api-server``, ``scheduler`` (LocalExecutor), ``dag-processor``
and ``triggerer`` processes on PostgreSQL (Debian's, installed if missing), with the DAGs of
``tests/deployment_dags`` and ``kubernetes_default`` pointing at the local test cluster.

- ``tests.airflow_services.pytest_plugin``: the session fixture ``airflow_services`` (needs ``kube_cluster``).
- ``python -m tests.airflow_services up|down|status``: the same for a person; ``up`` prints the API's base URL last.
- ``deployment``: start, restart, stop (from any process, through the state dir); ``client``: the REST API.
"""
