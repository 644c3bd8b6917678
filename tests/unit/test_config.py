"""The configuration matrix: every bad value fails at DAG parse time with the right type and a message that names the
field, the value given and what is expected; every valid spelling is normalised once."""

from __future__ import annotations

import dataclasses
import warnings
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_torchelastic.core.config import (
    CleanPodPolicy,
    Elastic,
    Master,
    PyTorch,
    RestartPolicy,
    RunPolicy,
    Worker,
    check_task_config,
)
from airflow_provider_torchelastic.core.validation import quantity_value

# (builder, field as it appears in the message, value as it appears in the message, exception, words of "expected")
INVALID: list[Any] = [
    # Elastic.nnodes
    pytest.param(lambda: Elastic(nnodes=0), "Elastic.nnodes", 0, ValueError, "int >= 1", id="nnodes-0"),
    pytest.param(lambda: Elastic(nnodes=-1), "Elastic.nnodes", -1, ValueError, "int >= 1", id="nnodes-neg"),
    pytest.param(lambda: Elastic(nnodes=True), "Elastic.nnodes", True, TypeError, "int >= 1", id="nnodes-bool"),
    pytest.param(lambda: Elastic(nnodes="0:2"), "Elastic.nnodes", "0:2", ValueError, "'min:max'", id="nnodes-0:2"),
    pytest.param(lambda: Elastic(nnodes="3:2"), "Elastic.nnodes", "3:2", ValueError, "min <= max", id="nnodes-3:2"),
    pytest.param(lambda: Elastic(nnodes="a"), "Elastic.nnodes", "a", ValueError, "'min:max'", id="nnodes-a"),
    pytest.param(
        lambda: Elastic(nnodes="1:2:3"), "Elastic.nnodes", "1:2:3", ValueError, "'min:max'", id="nnodes-3parts"
    ),
    pytest.param(lambda: Elastic(nnodes=2.5), "Elastic.nnodes", 2.5, TypeError, "int >= 1", id="nnodes-float"),
    # Elastic.nproc_per_node
    pytest.param(lambda: Elastic(nproc_per_node=0), "Elastic.nproc_per_node", 0, ValueError, "int >= 1", id="nproc-0"),
    pytest.param(
        lambda: Elastic(nproc_per_node="many"),
        "Elastic.nproc_per_node",
        "many",
        ValueError,
        "'auto', 'cpu', 'gpu'",
        id="nproc-many",
    ),
    pytest.param(
        lambda: Elastic(nproc_per_node=True), "Elastic.nproc_per_node", True, TypeError, "int >= 1", id="nproc-bool"
    ),
    # Elastic, other fields
    pytest.param(
        lambda: Elastic(start_method="forkserver"),
        "Elastic.start_method",
        "forkserver",
        ValueError,
        "'spawn' or 'fork'",
        id="start-method",
    ),
    pytest.param(
        lambda: Elastic(monitor_interval=0), "Elastic.monitor_interval", 0, ValueError, "seconds > 0", id="monitor-0"
    ),
    pytest.param(
        lambda: Elastic(monitor_interval=-1),
        "Elastic.monitor_interval",
        -1,
        ValueError,
        "seconds > 0",
        id="monitor-neg",
    ),
    pytest.param(lambda: Elastic(max_restarts=-1), "Elastic.max_restarts", -1, ValueError, "int >= 0", id="restarts"),
    pytest.param(
        lambda: Elastic(rdzv_configs=[("timeout", 5)]),
        "Elastic.rdzv_configs",
        [("timeout", 5)],
        TypeError,
        "mapping",
        id="rdzv-list",
    ),
    pytest.param(
        lambda: Elastic(run_policy={"backoff_limit": 1}),
        "Elastic.run_policy",
        {"backoff_limit": 1},
        TypeError,
        "RunPolicy(...)",
        id="run-policy-dict",
    ),
    # Master / Worker
    pytest.param(
        lambda: Master(requests=["cpu"]),
        "Master.requests",
        ["cpu"],
        TypeError,
        "mapping of resource name",
        id="requests",
    ),
    pytest.param(
        lambda: Worker(limits={"memory": "lots"}),
        "Worker.limits['memory']",
        "lots",
        ValueError,
        "Kubernetes quantity",
        id="quantity",
    ),
    pytest.param(
        lambda: Master(requests={"CPU cores": "2"}),
        "Master.requests",
        "CPU cores",
        ValueError,
        "resource names",
        id="resource-name",
    ),
    pytest.param(
        lambda: Master(restart_policy="Sometimes"),
        "Master.restart_policy",
        "Sometimes",
        ValueError,
        "'OnFailure'",
        id="restart-policy",
    ),
    pytest.param(lambda: Worker(replicas=-1), "Worker.replicas", -1, ValueError, "int >= 0", id="replicas"),
    pytest.param(lambda: Worker(image=" "), "Worker.image", " ", ValueError, "image reference", id="image"),
    # RunPolicy
    pytest.param(
        lambda: RunPolicy(ttl_seconds_after_finished=-5),
        "RunPolicy.ttl_seconds_after_finished",
        -5,
        ValueError,
        "int >= 0",
        id="ttl",
    ),
    pytest.param(
        lambda: RunPolicy(active_deadline_seconds=-1),
        "RunPolicy.active_deadline_seconds",
        -1,
        ValueError,
        "int >= 0",
        id="deadline-neg",
    ),
    pytest.param(
        lambda: RunPolicy(active_deadline_seconds=0),
        "RunPolicy.active_deadline_seconds",
        0,
        ValueError,
        "int >= 1",
        id="deadline-0",
    ),
    pytest.param(
        lambda: RunPolicy(backoff_limit=-2), "RunPolicy.backoff_limit", -2, ValueError, "int >= 0", id="backoff"
    ),
    pytest.param(
        lambda: RunPolicy(backoff_limit="3"), "RunPolicy.backoff_limit", "3", TypeError, "int >= 0", id="backoff-str"
    ),
    pytest.param(
        lambda: RunPolicy(clean_pod_policy="Some"),
        "RunPolicy.clean_pod_policy",
        "Some",
        ValueError,
        "'Running'",
        id="clean-pod-policy",
    ),
    # PyTorch
    pytest.param(
        lambda: PyTorch(worker=Worker(replicas=1), nproc_per_node=0),
        "PyTorch.nproc_per_node",
        0,
        ValueError,
        "int >= 1",
        id="pytorch-nproc",
    ),
    pytest.param(
        lambda: PyTorch(worker=Worker(replicas=1), start_method="forkserver"),
        "PyTorch.start_method",
        "forkserver",
        ValueError,
        "'spawn' or 'fork'",
        id="pytorch-start-method",
    ),
    pytest.param(
        lambda: PyTorch(master=Worker(replicas=1), worker=Worker(replicas=1)),
        "PyTorch.master",
        Worker(replicas=1),
        TypeError,
        "Master(...)",
        id="pytorch-master-type",
    ),
    # Elastic.monitor_interval: seconds, never a bool or NaN
    pytest.param(
        lambda: Elastic(monitor_interval=True),
        "Elastic.monitor_interval",
        True,
        TypeError,
        "seconds > 0",
        id="monitor-bool",
    ),
    pytest.param(
        lambda: Elastic(monitor_interval=float("nan")),
        "Elastic.monitor_interval",
        float("nan"),
        ValueError,
        "seconds > 0",
        id="monitor-nan",
    ),
    # Elastic.rdzv_configs: what torch reads as ints must be ints; nothing may break the k=v,k=v serialization
    pytest.param(
        lambda: Elastic(rdzv_configs={"timeout": 1.5}),
        "Elastic.rdzv_configs['timeout']",
        1.5,
        TypeError,
        "an int >= 1",
        id="rdzv-timeout-float",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"join_timeout": True}),
        "Elastic.rdzv_configs['join_timeout']",
        True,
        TypeError,
        "an int >= 1",
        id="rdzv-timeout-bool",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"last_call_timeout": "30"}),
        "Elastic.rdzv_configs['last_call_timeout']",
        "30",
        TypeError,
        "an int >= 1",
        id="rdzv-timeout-str",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"close_timeout": 0}),
        "Elastic.rdzv_configs['close_timeout']",
        0,
        ValueError,
        "an int >= 1",
        id="rdzv-timeout-0",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"keep_alive_max_attempt": 2.0}),
        "Elastic.rdzv_configs['keep_alive_max_attempt']",
        2.0,
        TypeError,
        "an int >= 1",
        id="rdzv-keep-alive-float",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"read_timeout": -1}),
        "Elastic.rdzv_configs['read_timeout']",
        -1,
        ValueError,
        "an int >= 1",
        id="rdzv-read-timeout",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"is_host": "maybe"}),
        "Elastic.rdzv_configs['is_host']",
        "maybe",
        TypeError,
        "a bool",
        id="rdzv-is-host",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"x": "a,b"}),
        "Elastic.rdzv_configs['x']",
        "a,b",
        ValueError,
        "without ',' or '='",
        id="rdzv-value-comma",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"x": "a=b"}),
        "Elastic.rdzv_configs['x']",
        "a=b",
        ValueError,
        "without ',' or '='",
        id="rdzv-value-equals",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"x": ""}),
        "Elastic.rdzv_configs['x']",
        "",
        ValueError,
        "non-empty",
        id="rdzv-value-empty",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"a=b": 1}),
        "Elastic.rdzv_configs",
        "a=b",
        ValueError,
        "without ',' or '='",
        id="rdzv-key-equals",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"a,b": 1}),
        "Elastic.rdzv_configs",
        "a,b",
        ValueError,
        "without ',' or '='",
        id="rdzv-key-comma",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"": 1}), "Elastic.rdzv_configs", "", ValueError, "non-empty", id="rdzv-key-empty"
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={1: 1}), "Elastic.rdzv_configs", 1, TypeError, "string keys", id="rdzv-key-int"
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"x": None}),
        "Elastic.rdzv_configs['x']",
        None,
        TypeError,
        "a str, int, float or bool",
        id="rdzv-value-none",
    ),
    pytest.param(
        lambda: Elastic(rdzv_configs={"x": [1, 2]}),
        "Elastic.rdzv_configs['x']",
        [1, 2],
        TypeError,
        "a str, int, float or bool",
        id="rdzv-value-list",
    ),
    # GPUs: Kubernetes has no "gpu" resource; the device plugins register vendor-prefixed names
    pytest.param(
        lambda: Worker(limits={"gpu": 1}), "Worker.limits", "gpu", ValueError, "'nvidia.com/gpu'", id="gpu-limit"
    ),
    pytest.param(
        lambda: Master(requests={"GPU": 1}), "Master.requests", "GPU", ValueError, "'amd.com/gpu'", id="gpu-upper"
    ),
    pytest.param(
        lambda: Worker(limits={"gpus": 2}), "Worker.limits", "gpus", ValueError, "'nvidia.com/gpu'", id="gpu-plural"
    ),
    pytest.param(
        lambda: Worker(limits={"nvidia.com/gpus": 2}),
        "Worker.limits",
        "nvidia.com/gpus",
        ValueError,
        "'nvidia.com/gpu'",
        id="gpu-vendor-plural",
    ),
    pytest.param(
        lambda: Worker(limits={"nvidia-gpu": 2}),
        "Worker.limits",
        "nvidia-gpu",
        ValueError,
        "'nvidia.com/gpu'",
        id="gpu-unprefixed",
    ),
    # One node runs as a plain Pod: job-level policies would be dropped silently
    pytest.param(
        lambda: Elastic(run_policy=RunPolicy(ttl_seconds_after_finished=60)),
        "Elastic.run_policy",
        RunPolicy(ttl_seconds_after_finished=60),
        ValueError,
        "ttl_seconds_after_finished",
        id="single-node-ttl",
    ),
    pytest.param(
        lambda: Elastic(nnodes="1:1", run_policy=RunPolicy(backoff_limit=2, clean_pod_policy="All")),
        "Elastic.run_policy",
        RunPolicy(backoff_limit=2, clean_pod_policy="All"),
        ValueError,
        "clean_pod_policy, backoff_limit",
        id="single-node-backoff-clean",
    ),
    # Replica images: a reference the container runtime can pull (replicas are not templated)
    pytest.param(
        lambda: Worker(image="Registry/Train:1"),
        "Worker.image",
        "Registry/Train:1",
        ValueError,
        "image reference",
        id="image-uppercase",
    ),
    pytest.param(
        lambda: Master(image="{{ var.value.image }}"),
        "Master.image",
        "{{ var.value.image }}",
        ValueError,
        "image reference",
        id="image-template",
    ),
    pytest.param(lambda: Master(image=3), "Master.image", 3, TypeError, "image reference", id="image-int"),
    pytest.param(
        lambda: Master(image="train:1\n"),
        "Master.image",
        "train:1\n",
        ValueError,
        "image reference",
        id="image-newline",
    ),
]


@pytest.mark.parametrize(("build", "field", "value", "exc", "expected"), INVALID)
def test_invalid_value_names_field_value_and_expectation(build, field, value, exc, expected) -> None:
    with pytest.raises(Exception) as info:
        build()
    # Exactly the documented type: a TypeError where a ValueError was promised (or the reverse) is a bug.
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith(f"{field}: "), message
    assert f"got {value!r}" in message, message
    assert "expected" in message and expected in message, message


def test_pytorch_needs_exactly_one_worker_count() -> None:
    with pytest.raises(ValueError) as both:
        PyTorch(num_workers=2, worker=Worker(replicas=3))
    assert "num_workers" in str(both.value) and "worker.replicas" in str(both.value)
    assert "num_workers=2" in str(both.value) and "worker.replicas=3" in str(both.value)

    with pytest.raises(ValueError) as neither:
        PyTorch()
    assert str(neither.value).startswith("PyTorch.worker.replicas: expected")
    assert "got None" in str(neither.value) and "Worker(replicas=N)" in str(neither.value)


def test_num_workers_is_deprecated_and_normalised_into_worker_replicas() -> None:
    with pytest.warns(DeprecationWarning, match=r"num_workers.*worker=Worker\(replicas") as record:
        job = PyTorch(num_workers=3, worker=Worker(limits={"cpu": 2}))
    # The warning points at the DAG author's line, not at the dataclass machinery.
    assert record[0].filename == __file__
    assert job.worker.replicas == 3 and job.worker_replicas == 3 and job.nnodes == 4
    assert job.worker.limits == {"cpu": "2"}, "normalising must keep the rest of the Worker"


def test_worker_replicas_needs_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = PyTorch(worker=Worker(replicas=0))
    assert job.nnodes == 1


@pytest.mark.parametrize(
    ("nnodes", "low", "high"), [(1, 1, 1), (3, 3, 3), ("3", 3, 3), ("2:4", 2, 4), ("1:1", 1, 1), (" 2:3", 2, 3)]
)
def test_nnodes_forms(nnodes: int | str, low: int, high: int) -> None:
    config = Elastic(nnodes=nnodes)
    assert (config.min_nodes, config.max_nodes) == (low, high)


@given(low=st.integers(-3, 12), high=st.integers(-3, 12))
def test_nnodes_range_valid_exactly_when_ordered_and_positive(low: int, high: int) -> None:
    text = f"{low}:{high}"
    if 1 <= low <= high:
        assert (Elastic(nnodes=text).min_nodes, Elastic(nnodes=text).max_nodes) == (low, high)
    else:
        with pytest.raises(ValueError, match=r"^Elastic\.nnodes: "):
            Elastic(nnodes=text)


@pytest.mark.parametrize(("given_", "stored"), [("auto", "auto"), ("gpu", "gpu"), ("cpu", "cpu"), ("4", 4), (2, 2)])
def test_nproc_per_node_forms(given_: int | str, stored: int | str) -> None:
    assert Elastic(nproc_per_node=given_).nproc_per_node == stored
    assert PyTorch(worker=Worker(replicas=1), nproc_per_node=given_).nproc_per_node == stored


def test_enums_coerced_from_their_api_spelling() -> None:
    master = Master(restart_policy="OnFailure")
    assert master.restart_policy is RestartPolicy.ON_FAILURE
    assert RunPolicy(clean_pod_policy="All").clean_pod_policy is CleanPodPolicy.ALL
    assert Worker(restart_policy="ExitCode").restart_policy is RestartPolicy.EXIT_CODE
    # Defaults: Airflow, not the cluster, decides about retries.
    assert Worker().restart_policy is RestartPolicy.NEVER
    assert RunPolicy().clean_pod_policy is None


def test_resources_normalised_to_quantity_strings() -> None:
    master = Master(requests={"cpu": 4, "memory": "16Gi"}, limits={"nvidia.com/gpu": 8, "cpu": 0.5})
    assert dict(master.requests) == {"cpu": "4", "memory": "16Gi"}
    assert dict(master.limits) == {"nvidia.com/gpu": "8", "cpu": "0.5"}
    with pytest.raises(TypeError):
        master.requests["cpu"] = "8"  # type: ignore[index]


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"cpu": "-1"}, r"^Master\.requests\['cpu'\]: expected a quantity >= 0, got '-1'$"),
        (
            {"nvidia.com/gpu": 0.5},
            r"^Master\.requests\['nvidia\.com/gpu'\]: expected a whole number of nvidia\.com/gpu \(a device plugin's "
            r"resource has no fractions\), got '0\.5'$",
        ),
        ({"storage": "1Gi"}, r"^Master\.requests: expected a container resource \('cpu', 'memory', .*, got 'storage'$"),
    ],
)
def test_resources_the_api_server_refuses_are_refused_naming_them(resources: dict[str, Any], message: str) -> None:
    # tests/cluster_tests/test_resource_rules.py holds these rules against the real kube-apiserver.
    with pytest.raises(ValueError, match=message):
        Master(requests=resources)
    # Whole device-plugin quantities, any spelling; hugepages and every domain's resources by name.
    master = Master(requests={"nvidia.com/gpu": "2.0", "hugepages-2Mi": "4Mi", "example.com/fpga": 1, "cpu": "1e-3"})
    assert dict(master.requests) == {
        "nvidia.com/gpu": "2.0",
        "hugepages-2Mi": "4Mi",
        "example.com/fpga": "1",
        "cpu": "1e-3",
    }


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("16Gi", Decimal(16 * 2**30)),
        ("1e3", Decimal(1000)),
        ("1.5k", Decimal(1500)),
        ("2", Decimal(2)),
        (2, Decimal(2)),
        (0.25, Decimal("0.25")),
        ("100n", Decimal("1e-7")),
        ("-1Mi", Decimal(-(2**20))),
        ("1e99999999999", None),
        ("16GB", None),
        ("", None),
        (None, None),
    ],
)
def test_quantity_value_reads_every_kubernetes_spelling(text: object, value: Decimal | None) -> None:
    assert quantity_value(text) == value


def test_rdzv_configs_defaults_merged_with_user_keys() -> None:
    assert dict(Elastic().rdzv_configs) == {"timeout": 900, "join_timeout": 900}
    user = {"join_timeout": 60, "last_call_timeout": 5}
    config = Elastic(rdzv_configs=user)
    assert dict(config.rdzv_configs) == {"timeout": 900, "join_timeout": 60, "last_call_timeout": 5}
    user["timeout"] = 1
    assert config.rdzv_configs["timeout"] == 900, "the config must not alias the caller's dict"
    # The defaults are shared: instances must not be able to change them for everyone.
    assert dict(Elastic().rdzv_configs) == {"timeout": 900, "join_timeout": 900}


def test_rdzv_configs_accept_what_torch_reads() -> None:
    from airflow_provider_torchelastic.core.launch import format_rdzv_conf

    configs = {
        "join_timeout": 60,
        "last_call_timeout": 5,
        "close_timeout": 10,
        "heartbeat_timeout": 30,
        "read_timeout": 60,
        "keep_alive_interval": 5,
        "keep_alive_max_attempt": 3,
        "is_host": False,
        "store_type": "tcp",
        "my_key": 0.5,  # keys torch does not know stay free-form
    }
    config = Elastic(nnodes=2, rdzv_configs=configs)
    assert dict(config.rdzv_configs) == {"timeout": 900, **configs}
    assert Elastic(rdzv_configs={"is_host": 1}).rdzv_configs["is_host"] == 1
    # What reaches --rdzv-conf splits back into exactly these pairs.
    pairs = [item.split("=") for item in format_rdzv_conf(config.rdzv_configs).split(",")]
    assert [key for key, _ in pairs] == list(config.rdzv_configs)


def test_single_node_refuses_job_level_run_policy_but_keeps_the_deadline() -> None:
    with pytest.raises(ValueError) as info:
        Elastic(nnodes=1, run_policy=RunPolicy(ttl_seconds_after_finished=60, backoff_limit=1, clean_pod_policy="All"))
    message = str(info.value)
    assert "clean_pod_policy, ttl_seconds_after_finished, backoff_limit" in message, message
    assert "multi-node" in message and "nnodes > 1" in message, message
    assert Elastic(run_policy=RunPolicy(active_deadline_seconds=60)).run_policy == RunPolicy(active_deadline_seconds=60)
    # More than one node, or a range, is a PyTorchJob, which honours them all.
    for nnodes in (2, "1:2"):
        Elastic(nnodes=nnodes, run_policy=RunPolicy(ttl_seconds_after_finished=60, backoff_limit=1))


@pytest.mark.parametrize(
    "image",
    [
        "train",
        "img/master:1",
        "registry.example.com/ml/train:1.0",
        "localhost:5000/ml/train",
        "ghcr.io/org/train-image_x:2.6-cuda12.4",
        "ghcr.io/a/b@sha256:" + "a" * 64,
        "registry.example.com:443/a/b:tag@sha256:" + "0" * 64,
    ],
)
def test_replica_image_references(image: str) -> None:
    assert Worker(image=image).image == image


@pytest.mark.parametrize(
    "config",
    [Elastic(), PyTorch(worker=Worker(replicas=1)), Master(), Worker(replicas=1), RunPolicy()],
    ids=lambda c: type(c).__name__,
)
def test_configs_are_frozen(config: object) -> None:
    name = dataclasses.fields(config)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, name, getattr(config, name))


@pytest.mark.parametrize(
    ("cls", "positional"), [(Elastic, 2), (PyTorch, Master()), (Master, "img"), (Worker, "img"), (RunPolicy, "All")]
)
def test_configs_are_keyword_only(cls: type, positional: object) -> None:
    with pytest.raises(TypeError, match="positional"):
        cls(positional)


def test_check_task_config_accepts_only_configs() -> None:
    elastic = Elastic()
    assert check_task_config(elastic) is elastic
    with pytest.raises(TypeError, match=r"task_config: expected Elastic\(...\) or PyTorch\(...\), got \{'nnodes': 2\}"):
        check_task_config({"nnodes": 2})
