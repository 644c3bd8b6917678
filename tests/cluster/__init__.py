"""A local Kubernetes test cluster: a real kube-apiserver 1.20.2 + etcd, the real PyTorchJob CRD, simulated
training operator and kubelet (API clients, no containers), and a fault-injecting proxy.

- ``python -m tests.cluster up|down|status [--state-dir DIR]``: a long-lived cluster for manual work.
- ``tests.cluster.pytest_plugin``: the ``kube_cluster`` session fixture (a fresh cluster per test session).
- ``tests.cluster.proxy.FaultProxy``: 429/500/503 answers, dropped connections, stalls and cut watches on demand.

Submodules are imported on use: the plugin is loaded by every test session and must stay cheap.
"""
