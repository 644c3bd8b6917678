"""The Kubernetes backend, never Airflow: manifests, job kinds, the pure decisions over what the API says, the wait
core, and the I/O (``client``: both Kubernetes clients behind one error boundary; ``watch``: the shared watch).

Only ``client`` and ``watch`` import a Kubernetes client; ``render``, ``kinds`` and ``status`` are pure.
"""
