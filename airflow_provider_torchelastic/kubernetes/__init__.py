"""The Kubernetes backend, never Airflow: each job kind (``kinds/``), the manifests, the pure decisions over what the
API says, the wait core, submission, and the I/O (``client``: both Kubernetes clients behind one error boundary;
``watch``: the triggerer's shared watch).

Only ``client`` and ``watch`` import a Kubernetes client; ``kinds``, ``pod_template``, ``render`` and ``status`` are
pure.
"""
