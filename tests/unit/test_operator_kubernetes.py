"""The operator's Kubernetes side without a cluster: render_manifests, parse-time checks, trigger serialization."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from pathlib import Path

import pytest
from airflow.sdk import DAG
from airflow.sdk.module_loading import import_string

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from airflow_provider_torchelastic.core.pod_options import PodOptions
from airflow_provider_torchelastic.kubernetes.render import UI_FOOTER
from airflow_provider_torchelastic.kubernetes.wait_types import Phase, WaitDecision
from airflow_provider_torchelastic.triggers import JobEnded, TorchElasticJobTrigger, WatchArgs, event_from_payload


def scale(x: int) -> int:
    return x * 2


def make_operator(**kwargs: object) -> TorchElasticOperator:
    with DAG("render_dag", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
        return TorchElasticOperator(
            task_id="train", python_callable=scale, op_args=[3], image="registry.example.com/train:1", **kwargs
        )


def test_render_manifests_without_a_run_or_a_connection() -> None:
    op = make_operator(task_config=Elastic(nnodes="2:4", nproc_per_node=2), execution="kubernetes")
    payload, job = op.render_manifests()
    assert payload["kind"] == "Secret" and job["kind"] == "PyTorchJob"
    assert job["spec"]["elasticPolicy"]["maxReplicas"] == 4 and job["spec"]["nprocPerNode"] == "2"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/train:1" and container["name"] == "pytorch"
    # The same inputs render the same objects (the payload bytes may differ between dumps; names and specs not).
    assert op.render_manifests()[1] == job


def test_single_node_renders_one_pod_and_pytorch_a_master_job() -> None:
    assert make_operator(task_config=Elastic(nproc_per_node=2)).render_manifests()[1]["kind"] == "Pod"
    job = make_operator(task_config=PyTorch(master=Master(), worker=Worker(replicas=2))).render_manifests()[1]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2


def test_conflicting_pod_template_fails_at_construction() -> None:
    template = {"spec": {"containers": [{"name": "pytorch", "command": ["bash"]}]}}
    with pytest.raises(ValueError, match="command"):
        make_operator(pod_options=PodOptions(pod_template=template))


def test_replica_limit_below_an_operator_request_fails_at_construction() -> None:
    # Each level alone is valid; merged, the pod would request more memory than its limit.
    config = PyTorch(master=Master(), worker=Worker(replicas=1, pod=PodOptions(limits={"memory": "1Gi"})))
    with pytest.raises(ValueError, match="memory"):
        make_operator(task_config=config, pod_options=PodOptions(requests={"memory": "2Gi"}))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"execution": "cloud"}, "execution"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"on_finish_action": "explode"}, "on_finish_action"),
        ({"task_config": {"nnodes": 2}}, "task_config"),
    ],
)
def test_bad_operator_arguments_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        make_operator(**kwargs)


def test_templated_image_is_accepted_at_parse_time() -> None:
    # A Jinja template is not a valid image reference yet; the parse-time render check must not reject it.
    with DAG("templated", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
        op = TorchElasticOperator(
            task_id="t", python_callable=scale, image="{{ var.value.training_image }}", task_config=Elastic(nnodes=2)
        )
    assert op.image == "{{ var.value.training_image }}"


def test_ui_summary_fits_the_rendered_field_limit() -> None:
    from airflow_provider_torchelastic.kubernetes.render import summarize_for_ui

    summary = summarize_for_ui(make_operator(task_config=Elastic(nnodes=3)).render_manifests())
    assert len(summary) <= 4096 and summary.rstrip().endswith(UI_FOOTER)


def test_trigger_serializes_to_json_and_rebuilds_identically() -> None:
    args = WatchArgs(
        kind="PyTorchJob",
        name="train-abc",
        namespace="ml",
        kubernetes_conn_id="kubernetes_default",
        connection_extras={"namespace": "ml"},
        poll_interval=3,
        deadline=1_900_000_000.0,
    )
    trigger = TorchElasticJobTrigger(**vars(args))
    classpath, kwargs = trigger.serialize()
    json.dumps(kwargs)  # stored in the metadata database
    rebuilt = import_string(classpath)(**kwargs)
    assert rebuilt.args == args and rebuilt.serialize() == (classpath, kwargs)


def test_trigger_for_an_unreachable_cluster_ends_in_a_recoverable_failure_not_a_crash() -> None:
    trigger = TorchElasticJobTrigger(
        kind="Pod",
        name="x",
        namespace="ml",
        kubernetes_conn_id=None,
        config_dict={
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "ctx",
        },
    )

    async def first_event() -> dict[str, object]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    # The retry loop reads its limit from kubernetes.retry (client only re-exports it): patched there, or the
    # refused connection is retried with back-off for minutes.
    import airflow_provider_torchelastic.kubernetes.retry as retry

    original = retry.MAX_RECOVERABLE_FAILURES
    retry.MAX_RECOVERABLE_FAILURES = 0  # connection refused is recoverable; do not back off in a unit test
    try:
        event = asyncio.run(first_event())
    finally:
        retry.MAX_RECOVERABLE_FAILURES = original
    # The wait core turns "cannot observe the job" into a recoverable failure (and tries to delete the job).
    ended = event_from_payload(event)
    assert isinstance(ended, JobEnded) and event == ended.to_payload()
    decision = ended.decision
    assert decision.phase is Phase.FAILED
    assert decision.verdict is not None and decision.verdict.recoverable
    assert "waiting for Pod ml/x failed" in decision.verdict.detail


def test_wait_decision_event_round_trip_is_json() -> None:
    decision = WaitDecision(phase=Phase.RUNNING, progress="Pod x: Running")
    event = json.loads(json.dumps(decision.to_event()))
    assert WaitDecision.from_event(event) == decision


def test_a_trigger_with_config_dict_alone_ignores_a_default_connection_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hook falls back to kubernetes_default when no connection id is given; with one in the environment, it used
    # to read it beside config_dict and refuse the pair ("mutually exclusive") once the wait had started.
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": '{"apiVersion": "v1"}'}}),
    )
    test_trigger_for_an_unreachable_cluster_ends_in_a_recoverable_failure_not_a_crash()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"kubernetes_conn_id": "k8s", "config_dict": {"apiVersion": "v1"}},
            "kubernetes_conn_id='k8s' and config_dict",
        ),
        ({"config_dict": {"apiVersion": "v1"}, "in_cluster": True}, "in_cluster=True and config_dict"),
        (
            {"kubernetes_conn_id": "k8s", "connection_extras": {"kube_config_path": "/k"}, "in_cluster": True},
            "sets kube_config_path",
        ),
    ],
)
def test_a_trigger_with_two_sources_of_cluster_settings_is_refused_when_built(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        TorchElasticJobTrigger(kind="Pod", name="x", namespace="ml", **kwargs)


def test_a_connection_that_gives_no_client_is_a_configuration_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from airflow_provider_torchelastic.hooks import connect
    from airflow_provider_torchelastic.operators import ConfigurationError
    from airflow_provider_torchelastic.operators.backends.cluster import cluster_client

    extra = {"kube_config_path": str(tmp_path / "no-such-kubeconfig")}
    monkeypatch.setenv("AIRFLOW_CONN_NOWHERE", json.dumps({"conn_type": "kubernetes", "extra": extra}))
    with pytest.raises(ConfigurationError) as raised:
        cluster_client(connect("nowhere"))
    message = str(raised.value)
    assert message.startswith("connection 'nowhere' gives no Kubernetes client (ConfigException: "), message
    assert "kube_config_path" in message and "torchelastic-preflight" in message
    assert not ConfigurationError.recoverable, "the same configuration fails every try: Airflow must not retry it"


def test_a_missing_connection_is_named_and_only_the_default_may_be_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic.operators import InfrastructureError
    from airflow_provider_torchelastic.operators.backends.cluster import task_cluster

    monkeypatch.delenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", raising=False)
    with pytest.raises(InfrastructureError) as raised:
        task_cluster("no_such_conn", None)
    message = str(raised.value)
    assert message.startswith("kubernetes_conn_id='no_such_conn': Airflow found no such connection ("), message
    assert "'kubernetes_default' may be left undefined" in message and "secrets backend" in message, message
    # Retried: Airflow says "isn't defined" too when the secrets backend holding it did not answer.
    assert raised.value.recoverable
    # Undefined, the default connection is the worker's own cluster: connecting reads nothing yet.
    assert task_cluster("kubernetes_default", "ml").namespace == "ml"


def test_a_connection_with_two_ways_to_reach_a_cluster_fails_at_submit_without_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_provider_torchelastic.hooks import connect
    from airflow_provider_torchelastic.operators import ConfigurationError
    from airflow_provider_torchelastic.operators.backends.cluster import cluster_client

    extra = {"in_cluster": True, "kube_config_path": "/etc/kube/config"}
    monkeypatch.setenv("AIRFLOW_CONN_TWO_WAYS", json.dumps({"conn_type": "kubernetes", "extra": extra}))
    with pytest.raises(ConfigurationError, match=r"^connection 'two_ways' sets in_cluster and kube_config_path"):
        cluster_client(connect("two_ways"))
    # One way: past that check (here, outside a pod, the service account's refusal comes next).
    monkeypatch.setenv("AIRFLOW_CONN_ONE_WAY", json.dumps({"conn_type": "kubernetes", "extra": {"in_cluster": True}}))
    with pytest.raises(ConfigurationError, match=r"^connection 'one_way' gives no Kubernetes client"):
        cluster_client(connect("one_way"))


def test_stopping_a_job_without_the_trys_client_connects_as_a_submit_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """on_kill after a resume (or a trigger that could not wait) has no client of the try: the cluster is connected
    the one way a submit connects it, so a connection that does not exist is the typed, named error."""
    from airflow_provider_torchelastic import TorchElasticOperator
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
    from airflow_provider_torchelastic.operators import InfrastructureError
    from airflow_provider_torchelastic.operators.backends.kubernetes import stop
    from airflow_provider_torchelastic.operators.operator import _task_spec

    op = TorchElasticOperator(task_id="t", python_callable=print, image="i:1", kubernetes_conn_id="no_such_conn")
    with pytest.raises(InfrastructureError, match=r"^kubernetes_conn_id='no_such_conn': Airflow found no such"):
        stop(_task_spec(op), JobRef(kind="PyTorchJob", name="j", namespace="ml"))
