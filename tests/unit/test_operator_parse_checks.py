"""What TorchElasticOperator and @task.torch_elastic check while the DAG file is parsed (mapped tasks included), where
a task's image comes from, and what ``render_manifests()`` shows before there is a run."""

from __future__ import annotations

import datetime
import json
import warnings
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk import DAG, task
from airflow.sdk.definitions.mappedoperator import MappedOperator

from airflow_provider_torchelastic import Elastic, Master, PyTorch, TorchElasticOperator, Worker
from airflow_provider_torchelastic.core.pod_options import PodOptions

START = datetime.datetime(2026, 1, 1)
IMAGE = "registry.example.com/ml/train:1"
TEMPLATE_IMAGE = PodOptions(
    pod_template={"spec": {"containers": [{"name": "pytorch", "image": "tpl.example.com/t:1"}]}}
)
NO_IMAGE_PLACES = ("image=", "Master/Worker(image=...)", "pod_template", "[torch_elastic] image")


@pytest.fixture(autouse=True)
def _default_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test sets what it needs: by default no configured image, and execution "kubernetes" (the option's default).
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__IMAGE", raising=False)
    monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", raising=False)


def scale(x: int) -> int:
    return x * 2


def make(**kwargs: Any) -> TorchElasticOperator:
    values: dict[str, Any] = {"task_id": "train", "python_callable": scale, "op_args": [3]}
    values.update(kwargs)
    with DAG("parse_checks", schedule=None, start_date=START, params={"tag": "1.2"}):
        return TorchElasticOperator(**values)


def images(op: TorchElasticOperator) -> set[str]:
    workload = op.render_manifests()[1]
    if workload["kind"] == "Pod":
        specs = [workload["spec"]]
    else:
        specs = [r["template"]["spec"] for r in workload["spec"]["pytorchReplicaSpecs"].values()]
    return {c["image"] for spec in specs for c in spec["containers"] if c["name"] == "pytorch"}


# --------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"poll_interval": True}, TypeError, r"^poll_interval: expected a number of seconds > 0, got True$"),
        ({"poll_interval": "10"}, TypeError, r"^poll_interval: expected a number of seconds > 0, got '10'$"),
        ({"poll_interval": float("inf")}, ValueError, r"^poll_interval: expected a number of seconds > 0, got inf$"),
        (
            {"pending_grace_seconds": True},
            TypeError,
            r"^pending_grace_seconds: expected a number of seconds >= 0, got True$",
        ),
        (
            {"pending_grace_seconds": -1},
            ValueError,
            r"^pending_grace_seconds: expected a number of seconds >= 0, got -1$",
        ),
        (
            {"pending_grace_seconds": float("nan")},
            ValueError,
            r"^pending_grace_seconds: expected a number of seconds >= 0, got nan$",
        ),
        ({"scheduling_timeout": True}, TypeError, r"^scheduling_timeout: expected a number of seconds > 0, got True$"),
        ({"scheduling_timeout": 0}, ValueError, r"^scheduling_timeout: expected a number of seconds > 0, got 0$"),
        ({"deferrable": "yes"}, TypeError, r"^deferrable: expected True, False or None.*, got 'yes'$"),
        ({"namespace": "ML team"}, ValueError, r"^namespace: expected a namespace name .*, got 'ML team'$"),
        ({"kubernetes_conn_id": 3}, TypeError, r"^kubernetes_conn_id: expected a connection id .*, got 3$"),
        ({"image": "Registry/Train:1"}, ValueError, r"^image: expected an image reference .*, got 'Registry/Train:1'$"),
        ({"image": ""}, ValueError, r"^image: expected an image reference .*, got ''$"),
        ({"on_finish_action": "explode"}, ValueError, r"^on_finish_action: expected one of .*, got 'explode'$"),
    ],
)
def test_bad_arguments_fail_at_parse_time(kwargs: dict[str, Any], exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message) as info:
        make(image=IMAGE, **kwargs) if "image" not in kwargs else make(**kwargs)
    assert type(info.value) is exc


def yields_losses(x: int) -> Iterator[int]:
    yield x


async def streams_losses(x: int) -> AsyncIterator[int]:
    yield x


async def trains_async(x: int) -> int:
    return x


@pytest.mark.parametrize("fn", [yields_losses, streams_losses])
def test_a_generator_function_fails_at_parse_time_with_the_operator_and_the_decorator(fn: Any) -> None:
    # Its call only makes a generator: nothing of it would run, and rank 0's value would be the generator.
    message = r"^python_callable: expected a function that returns its result \(this one yields: .*\), got <function"
    with pytest.raises(TypeError, match=message):
        make(image=IMAGE, python_callable=fn)
    with pytest.raises(TypeError, match=message), DAG("parse_checks", schedule=None, start_date=START):
        task.torch_elastic(task_config=Elastic(), image=IMAGE)(fn)(3)


def test_an_async_function_is_a_training_function() -> None:
    # The runner runs it to its end in each worker (tests/runner/test_runner.py), as Airflow's @task awaits one.
    assert make(image=IMAGE, python_callable=trains_async).training_call() == (trains_async, [3], {})


def train_with_ti(epochs: int, ti: Any = None) -> int:
    return epochs


def train_with_context_values(epochs: int, ds: str | None = None, params: Any = None) -> int:
    return epochs


def test_a_parameter_waiting_for_a_live_context_object_fails_at_parse_time() -> None:
    # @task would fill ``ti``; the training function runs where the task instance does not exist.
    message = (
        r"^python_callable: parameter 'ti' waits for Airflow's context\['ti'\], a live Airflow object, .*current\(\)"
    )
    with pytest.raises(TypeError, match=message):
        make(image=IMAGE, python_callable=train_with_ti)
    with pytest.raises(TypeError, match=message), DAG("parse_checks", schedule=None, start_date=START):
        task.torch_elastic(task_config=Elastic(), image=IMAGE)(train_with_ti)(3)
    # Given by the call, it is an argument like any other; plain values (ds, params) reach the workers.
    make(image=IMAGE, python_callable=train_with_ti, op_args=[3, "mine"])
    make(image=IMAGE, python_callable=train_with_ti, op_args=[], op_kwargs={"epochs": 3, "ti": "mine"})
    make(image=IMAGE, python_callable=train_with_context_values)


def test_the_context_values_are_standard_types_and_a_mapped_call_is_checked_at_run_time() -> None:
    import pendulum
    from airflow.sdk.definitions.param import ParamsDict

    from airflow_provider_torchelastic.operators.context_arguments import context_arguments
    from airflow_provider_torchelastic.operators.exceptions import ConfigurationError

    when = pendulum.datetime(2026, 3, 1, 12, tz="Europe/Paris")
    context = {"ds": "2026-03-01", "params": ParamsDict({"lr": 0.1}), "logical_date": when, "ti": object()}

    def train(epochs: int, ds: str, params: Any = None, logical_date: Any = None, run_id: Any = None) -> None: ...

    filled = context_arguments(train, [], {"epochs": 3, "ds": "mine"}, context)
    assert filled == {"epochs": 3, "ds": "mine", "params": {"lr": 0.1}, "logical_date": when, "run_id": None}
    assert type(filled["params"]) is dict and type(filled["logical_date"]) is datetime.datetime
    assert filled["logical_date"].utcoffset() == datetime.timedelta(hours=1)
    with pytest.raises(ConfigurationError, match=r"^python_callable: parameter 'ti' waits for"):
        context_arguments(train_with_ti, [], {"epochs": 3}, context)


def test_good_seconds_are_kept_as_floats() -> None:
    op = make(image=IMAGE, poll_interval=2, pending_grace_seconds=0, scheduling_timeout=600)
    assert (op.poll_interval, op.pending_grace_seconds, op.scheduling_timeout) == (2.0, 0.0, 600.0)
    assert make(image=IMAGE).scheduling_timeout is None, "default: wait for capacity until execution_timeout"


def test_the_constructor_takes_exactly_the_arguments_dataclass_and_its_defaults() -> None:
    import dataclasses
    import inspect

    from airflow_provider_torchelastic.operators import arguments

    init = inspect.signature(TorchElasticOperator.__init__).parameters
    own = {name: p for name, p in init.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    declared = {f.name: f.default for f in dataclasses.fields(arguments.OperatorArguments)}
    assert list(own) == list(declared)
    for name, parameter in own.items():
        if parameter.default is not inspect.Parameter.empty:  # python_callable is required by the constructor
            assert parameter.default == declared[name], name
    # Every field is checked, in the table's one row for it.
    assert sorted(row.name for row in arguments._ARGUMENT_CHECKS) == sorted(declared)


# ------------------------------------------------------------------------------------------------- images


def test_image_may_come_from_the_pod_template_alone() -> None:
    for config in (Elastic(), Elastic(nnodes=2)):
        assert images(make(task_config=config, pod_options=TEMPLATE_IMAGE)) == {"tpl.example.com/t:1"}


def test_image_may_come_from_the_replicas_alone() -> None:
    op = make(task_config=PyTorch(master=Master(image="m:1"), worker=Worker(replicas=1, image="w:1")))
    assert images(op) == {"m:1", "w:1"}


def test_operator_image_wins_over_the_template_without_a_conflict() -> None:
    assert images(make(image=IMAGE, pod_options=TEMPLATE_IMAGE)) == {IMAGE}
    # A templated image is only known at run time; it is not a conflict either.
    make(image="{{ var.value.training_image }}", pod_options=TEMPLATE_IMAGE, task_config=Elastic(nnodes=2))


@pytest.mark.parametrize("execution", ["kubernetes", None])
def test_no_image_anywhere_fails_at_parse_time_on_kubernetes(execution: str | None) -> None:
    with pytest.raises(ValueError) as info:
        make(execution=execution)
    message = str(info.value)
    for place in (*NO_IMAGE_PLACES, "AIRFLOW__TORCH_ELASTIC__IMAGE"):
        assert place in message, (place, message)


def test_a_replica_without_an_image_is_named() -> None:
    with pytest.raises(ValueError, match=r"pytorchReplicaSpecs\.Worker\.template.*image: expected an image"):
        make(task_config=PyTorch(master=Master(image="m:1"), worker=Worker(replicas=1)), execution="kubernetes")


def test_local_execution_needs_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    make(execution="local")
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "local")
    op = make()  # execution=None: read from the configuration, here local
    assert op.execution is None
    # A conflict in the pod options is still a bug when the configured execution is local.
    with pytest.raises(ValueError, match="command"):
        make(pod_options=PodOptions(pod_template={"spec": {"containers": [{"name": "pytorch", "command": ["x"]}]}}))


def test_configured_image_is_the_last_resort(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__IMAGE", "cfg.example.com/runner:1")
    assert images(make()) == {"cfg.example.com/runner:1"}
    assert images(make(pod_options=TEMPLATE_IMAGE)) == {"tpl.example.com/t:1"}
    assert images(make(image=IMAGE, pod_options=TEMPLATE_IMAGE)) == {IMAGE}
    op = make(task_config=PyTorch(master=Master(image="m:1"), worker=Worker(replicas=1)))
    assert images(op) == {"m:1", "cfg.example.com/runner:1"}


def test_a_bad_configured_image_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__IMAGE", "Not An Image")
    with pytest.raises(ValueError, match=r"^\[torch_elastic\] image: expected an image reference .*'Not An Image'"):
        make()


def test_the_placeholder_image_is_gone() -> None:
    import airflow_provider_torchelastic.operators as operators

    assert not hasattr(operators, "_PLACEHOLDER_IMAGE")


# --------------------------------------------------------------------------------------- render_manifests()


def _text(manifests: list[dict[str, Any]]) -> str:
    return json.dumps(manifests)


def test_render_manifests_renders_what_it_can_without_a_run() -> None:
    op = make(image="registry.example.com/train:{{ params.tag }}", namespace="team-{{ task.task_id }}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        payload, pod = op.render_manifests()
    assert pod["metadata"]["namespace"] == payload["metadata"]["namespace"] == "team-train"
    assert pod["spec"]["containers"][0]["image"] == "registry.example.com/train:1.2"
    assert "{{" not in _text([payload, pod])
    assert op.image == "registry.example.com/train:{{ params.tag }}", "rendering must not change the operator"


def test_render_manifests_names_what_only_a_run_can_render(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_VAR_MISSING_IMAGE", raising=False)
    op = make(
        image="{{ var.value.missing_image }}",
        namespace="{{ ti.xcom_pull(task_ids='setup') }}",
        op_kwargs={"path": "{{ ti.xcom_pull(task_ids='prepare') }}"},
        op_args=[],
        task_config=Elastic(nnodes=2),
    )
    with pytest.warns(UserWarning) as record:
        payload, job = op.render_manifests()
    message = " ".join(str(w.message) for w in record)
    for field in ("image", "namespace", "op_kwargs"):
        assert f"{field} (" in message, message
    assert "default" in message and "placeholder" in message, message
    assert job["metadata"]["namespace"] == payload["metadata"]["namespace"] == "default"
    assert "{{" not in _text([payload, job])


def test_render_manifests_renders_variables_it_can_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_TRAINING_IMAGE", "var.example.com/train:7")
    op = make(image="{{ var.value.training_image }}")
    assert images(op) == {"var.example.com/train:7"}


def test_render_manifests_with_a_run_context() -> None:
    op = make(image="registry.example.com/train:{{ params.tag }}", namespace="{{ params.ns }}")
    ti = SimpleNamespace(dag_id="parse_checks", task_id="train", run_id="manual__1", map_index=-1, try_number=2)
    context: Any = {"ti": ti, "task_instance": ti, "params": {"tag": "9", "ns": "ml"}, "run_id": "manual__1"}
    _, pod = op.render_manifests(context)
    assert pod["metadata"]["namespace"] == "ml"
    assert pod["spec"]["containers"][0]["image"] == "registry.example.com/train:9"
    assert pod["metadata"]["labels"]["torchelastic.airflow.apache.org/try-number"] == "2"


# ------------------------------------------------------------------------------------------------- mapped


def mapped_dag() -> DAG:
    return DAG("mapped_checks", schedule=None, start_date=START)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"task_config": {"nnodes": 2}, "image": IMAGE}, TypeError, "task_config"),
        ({"poll_interval": True, "image": IMAGE}, TypeError, "poll_interval"),
        ({"image": "Registry/Train:1"}, ValueError, "image: expected an image reference"),
        ({"execution": "kubernetes"}, ValueError, r"\[torch_elastic\] image"),
        ({"execution": "cloud"}, ValueError, "execution"),
    ],
)
def test_mapped_operator_is_checked_at_parse_time(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with mapped_dag(), pytest.raises(exc, match=match):
        TorchElasticOperator.partial(task_id="train", python_callable=scale, **kwargs).expand(op_args=[[1], [2]])


def test_mapped_values_are_left_to_run_time() -> None:
    with mapped_dag():
        # The image is mapped: known per map index only at run time (then __init__ checks it).
        mapped = TorchElasticOperator.partial(task_id="a", python_callable=scale, op_args=[1]).expand(
            image=["a.example.com/t:1", "b.example.com/t:1"]
        )
        assert isinstance(mapped, MappedOperator)
        TorchElasticOperator.partial(task_id="b", python_callable=scale, op_args=[1]).expand_kwargs(
            [{"image": "a.example.com/t:1"}, {"image": "b.example.com/t:1"}]
        )
        # Everything not mapped is still checked.
        with pytest.raises(TypeError, match="poll_interval"):
            TorchElasticOperator.partial(task_id="c", python_callable=scale, poll_interval=True).expand(
                image=["a.example.com/t:1"]
            )


def test_mapped_values_are_checked_when_the_run_expands_them() -> None:
    with mapped_dag():
        mapped = TorchElasticOperator.partial(task_id="train", python_callable=scale, op_args=[1]).expand(
            image=["a.example.com/t:1", "Not An Image"]
        )
    # What the run does per map index: build the operator from the partial and the resolved mapped values.
    assert mapped.unmap({"image": "a.example.com/t:1"}).image == "a.example.com/t:1"
    with pytest.raises(ValueError, match=r"^image: expected an image reference .*'Not An Image'"):
        mapped.unmap({"image": "Not An Image"})


def test_mapped_operator_takes_dag_default_args() -> None:
    with DAG("defaults", schedule=None, start_date=START, default_args={"image": IMAGE}):
        TorchElasticOperator.partial(task_id="train", python_callable=scale).expand(op_args=[[1], [2]])


def test_mapped_decorator_is_checked_at_parse_time() -> None:
    @task.torch_elastic(task_config={"nnodes": 2}, image=IMAGE)
    def bad_config(x: int) -> int:
        return x

    @task.torch_elastic(execution="kubernetes")
    def no_image(x: int, y: int) -> int:
        return x + y

    @task.torch_elastic(image=IMAGE, pending_grace_seconds=True)
    def bad_grace(x: int) -> int:
        return x

    with mapped_dag():
        with pytest.raises(TypeError, match="task_config"):
            bad_config.expand(x=[1, 2])
        with pytest.raises(ValueError, match=r"\[torch_elastic\] image"):
            no_image.partial(y=1).expand(x=[1, 2])
        with pytest.raises(ValueError, match=r"\[torch_elastic\] image"):
            no_image.expand_kwargs([{"x": 1, "y": 2}])
        with pytest.raises(TypeError, match="pending_grace_seconds"):
            bad_grace.override(task_id="grace").expand(x=[1, 2])


def test_valid_mapped_decorator_still_maps() -> None:
    @task.torch_elastic(task_config=Elastic(nnodes=2), image=IMAGE)
    def train(x: int, y: int) -> int:
        return x + y

    @task.torch_elastic(execution="local")
    def local(x: int) -> int:
        return x

    with mapped_dag():
        assert isinstance(train.partial(y=1).expand(x=[1, 2]).operator, MappedOperator)
        assert isinstance(local.expand(x=[1, 2]).operator, MappedOperator)
        assert isinstance(train.override(image="{{ params.image }}").expand(x=[1]).operator, MappedOperator)
        train(1, 2)  # the unmapped call still works
