"""The pure core: what a task is and what its workers report, with no I/O and no Airflow, Kubernetes client or torch.

Typed config and pod options, naming, the shared checks, the launch command line, the payload format, outcomes and
their encoding, the run context's locations, the metrics wire format and its Airflow-side tap, and the job summary.
Every other layer imports it; it imports only itself (import-linter's contracts in pyproject.toml say so, and
``make test`` checks them).
"""
