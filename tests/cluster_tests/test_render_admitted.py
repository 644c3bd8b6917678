"""Configurations drawn from the whole valid space (tests/contract/test_render_properties.py's strategies) render
objects that the real kube-apiserver admits: the Secret, and the Pod (the API server's full Pod validation), the
PyTorchJob or the TrainJob (their CRDs' schemas), each created as a dry run. The contract tier checks the same
objects against JSON schemas only."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import config as kube_config
from kubernetes import dynamic
from kubernetes.client.rest import ApiException

from airflow_provider_torchelastic.core.config import Elastic, TaskConfig
from airflow_provider_torchelastic.core.naming import RunIdentity
from airflow_provider_torchelastic.core.pod_options import JobOptions, PodOptions
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes.render import render_manifests
from tests.cluster.pytest_plugin import KubeCluster
from tests.contract import test_render_properties as drawn

pytestmark = pytest.mark.cluster

#: kube-apiserver 1.20's CRD validation (go-openapi's type validator, since fixed there) takes an empty string in a
#: map, such as a label or nodeSelector value "", for null and refuses it: valid Kubernetes, which later API servers
#: and the Pod validation accept. The only refusal passed over.
_OLD_EMPTY_STRING_BUG = 'must be of type string: "null"'


def _refusals(error: ApiException) -> list[str]:
    try:
        causes = [cause["message"] for cause in json.loads(error.body)["details"]["causes"]]
    except (ValueError, KeyError, TypeError):
        return [str(error.body)]
    return [cause for cause in causes if _OLD_EMPTY_STRING_BUG not in cause]


#: What a TrainJob runs (a fixed number of nodes, no restarts in place), so that about a third of the examples are one.
trainjob_config = st.builds(Elastic, nnodes=st.integers(2, 8), nproc_per_node=drawn.nproc)


def test_every_valid_configuration_renders_what_the_api_server_admits(kube_cluster: KubeCluster) -> None:
    refused: list[str] = []
    admitted: set[str] = set()
    with kube_config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)) as api_client:
        api = dynamic.DynamicClient(api_client)
        namespace = kube_cluster.namespace

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            config=drawn.elastic | drawn.pytorch | trainjob_config,
            options=st.none() | drawn.pod_options(),
            job=st.none() | drawn.job_options,
            who=drawn.identity,
        )
        def render_and_create(
            config: TaskConfig, options: PodOptions | None, job: JobOptions | None, who: RunIdentity
        ) -> None:
            trainjob = kinds.get("TrainJob").accepts(config)
            kind = kinds.get("TrainJob") if trainjob else kinds.for_config(config)
            if kind is kinds.POD:
                job = None  # refused for a single Pod (test_render_contract)
            try:
                manifests = render_manifests(
                    config,
                    identity=who,
                    namespace=namespace,
                    image="registry.example.com/ml/train:1.0",
                    payload=b"payload",
                    pod_options=options,
                    job_options=job,
                    renderer=kind.render,
                )
            except ValueError:
                assert trainjob, "only a TrainJob may refuse a valid configuration (options it has no field for)"
                return
            for manifest in manifests:
                resource = api.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
                try:
                    resource.create(body=manifest, namespace=namespace, query_params=[("dryRun", "All")])
                except ApiException as e:
                    if causes := _refusals(e):
                        refused.append(f"{manifest['kind']}: {causes}\n  config={config!r}\n  options={options!r}")
                    continue
                admitted.add(manifest["kind"])

        render_and_create()
    assert not refused, "\n".join(refused[:5])
    assert admitted == {"Secret", "Pod", "PyTorchJob", "TrainJob"}, admitted
