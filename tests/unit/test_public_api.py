"""The public surface: exactly the names we mean to export, a light import for DAG files, and a provider that
Airflow discovers."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import airflow_provider_torchelastic
from airflow_provider_torchelastic import errors, metrics
from airflow_provider_torchelastic.core import choices, config, pod_options
from tests.conftest import REPO_ROOT

DIST = "airflow-provider-torchelastic"
EXPORTED = {
    "TorchElasticOperator",
    "Elastic",
    "PyTorch",
    "Master",
    "Worker",
    "RunPolicy",
    "RestartPolicy",
    "CleanPodPolicy",
    "RecoverableError",
    # What nearly every Kubernetes task customizes (core/pod_options.py), and the operator's fixed choices as str
    # enums (core/choices.py).
    "PodOptions",
    "JobOptions",
    "Execution",
    "TrainingJobKind",
    "OnFinishAction",
    # Modules for the training function (standard library only when imported): context.current() and the
    # checkpoint helpers.
    "checkpoint",
    "context",
    # Downstream of a training task: artifacts.load(value) materializes its tensors, state dicts and models
    # (standard library only when imported; torch, numpy and safetensors when an artifact is read).
    "artifacts",
    # report(step=..., **metrics) from the training function (metrics.py, standard library only).
    "report",
    # set_result(value) from a module= or script= task: rank 0's value (worker/program.py, standard library only).
    "set_result",
}


def run_python(
    code: str, *, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def test_all_is_exactly_the_intended_surface() -> None:
    assert set(airflow_provider_torchelastic.__all__) == EXPORTED
    assert len(airflow_provider_torchelastic.__all__) == len(EXPORTED), "no duplicates"


def test_every_exported_name_resolves_to_its_definition() -> None:
    from airflow_provider_torchelastic import artifacts, checkpoint, context
    from airflow_provider_torchelastic.operators import TorchElasticOperator
    from airflow_provider_torchelastic.worker import program

    modules = {"checkpoint": checkpoint, "context": context, "artifacts": artifacts}
    expected = {
        "TorchElasticOperator": TorchElasticOperator,
        "RecoverableError": errors.RecoverableError,
        "report": metrics.report,
        "set_result": program.set_result,
        "PodOptions": pod_options.PodOptions,
        "JobOptions": pod_options.JobOptions,
        "Execution": choices.Execution,
        "TrainingJobKind": choices.TrainingJobKind,
        "OnFinishAction": choices.OnFinishAction,
        **modules,
    }
    expected |= {name: getattr(config, name) for name in EXPORTED - set(expected)}
    for name in EXPORTED:
        assert getattr(airflow_provider_torchelastic, name) is expected[name], name
    assert set(dir(airflow_provider_torchelastic)) >= EXPORTED
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        airflow_provider_torchelastic.Missing  # noqa: B018


HEAVY_MODULES_CHECK = """
    import json, sys
    {imports}
    heavy = sorted(
        name for name in sys.modules
        if name.split(".")[0] == "torch" or name.split(".")[0].startswith("kubernetes")
    )
    print(json.dumps(heavy))
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import airflow_provider_torchelastic",
        "from airflow_provider_torchelastic import TorchElasticOperator, Elastic, PyTorch",
        "import airflow_provider_torchelastic.decorators",
        "import example_dags.torch_elastic_quickstart",
        "from airflow_provider_torchelastic import artifacts",
    ],
    ids=["package", "operator", "decorator", "quickstart-dag", "artifacts"],
)
def test_dag_file_imports_leave_torch_and_kubernetes_out(imports: str) -> None:
    # The quickstart names no image: where Kubernetes is the default execution, the configured image is its image.
    image = {"AIRFLOW__TORCH_ELASTIC__IMAGE": "registry.example.com/ml/torchelastic-runner:0.1.0"}
    proc = run_python(HEAVY_MODULES_CHECK.format(imports=imports), env=image)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


RUN_TIME_MODULES_CHECK = """
    import json, sys
    {imports}
    run_time = sorted(
        name for name in sys.modules
        if name == "cloudpickle"
        or name.startswith("airflow_provider_torchelastic.kubernetes")
        or name.startswith("airflow_provider_torchelastic.local")
        or name.startswith("airflow_provider_torchelastic.runner")
        or name.startswith("airflow_provider_torchelastic.core.payload")
        or name.startswith("airflow_provider_torchelastic.triggers")
        or name.startswith("airflow_provider_torchelastic.operators.backends")
        or name in {{
            "airflow_provider_torchelastic.operators." + module
            for module in ("results", "spill", "masking")
        }}
    )
    print(json.dumps(run_time))
"""


@pytest.mark.parametrize(
    "imports",
    [
        "from airflow_provider_torchelastic import TorchElasticOperator, Elastic, PyTorch",
        "import airflow_provider_torchelastic.decorators",
        "from airflow_provider_torchelastic import TorchElasticOperator\n"
        "    TorchElasticOperator(task_id='t', python_callable=print, execution='local')",
    ],
    ids=["operator", "decorator", "local-task"],
)
def test_importing_the_operator_leaves_what_a_run_needs_out(imports: str) -> None:
    # Issue 39: a DAG file's import of the operator costs at most 50 ms over airflow.sdk's (benchmarks/
    # import_cost.py). The Kubernetes backend (renderer, kinds, decisions), the payload and the operator's run-time
    # modules were most of it; a Kubernetes task's parse-time check imports the renderer, a run the rest.
    proc = run_python(RUN_TIME_MODULES_CHECK.format(imports=imports))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_runner_modules_import_without_airflow() -> None:
    proc = run_python(
        """
        import sys
        import airflow_provider_torchelastic.runner, airflow_provider_torchelastic.core.outcome
        import airflow_provider_torchelastic.core.payload, airflow_provider_torchelastic.errors
        import airflow_provider_torchelastic.core.config
        import airflow_provider_torchelastic.metrics, airflow_provider_torchelastic.core.summary
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("airflow", "torch", "kubernetes")))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_provider_info_package_name_matches_the_distribution() -> None:
    info = airflow_provider_torchelastic.get_provider_info()
    dist = importlib.metadata.distribution(DIST)
    assert info["package-name"] == DIST == canonical(dist.metadata["Name"])
    assert info["versions"][0] == dist.version == airflow_provider_torchelastic.__version__


def test_provider_info_is_valid_for_airflow() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(airflow_provider_torchelastic.get_provider_info(), schema)
    decorators = airflow_provider_torchelastic.get_provider_info()["task-decorators"]
    assert decorators == [
        {"name": "torch_elastic", "class-name": "airflow_provider_torchelastic.decorators.torch_elastic_task"}
    ]


def test_provider_entry_point() -> None:
    points = [
        ep
        for ep in importlib.metadata.entry_points(group="apache_airflow_provider")
        if ep.dist and ep.dist.name == DIST
    ]
    assert [(ep.name, ep.value) for ep in points] == [
        ("provider_info", "airflow_provider_torchelastic:get_provider_info")
    ]
    assert points[0].load() is airflow_provider_torchelastic.get_provider_info


def test_the_command_line_tools_are_console_scripts() -> None:
    from airflow_provider_torchelastic import preflight
    from airflow_provider_torchelastic.kubernetes import sweep

    points = {
        ep.name: ep
        for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.dist and ep.dist.name == DIST
    }
    assert {name: ep.load() for name, ep in points.items()} == {
        "torchelastic-preflight": preflight.main,
        "torchelastic-sweep": sweep.main,
    }
    for name in points:  # installed beside this interpreter, and each says how it is used
        proc = subprocess.run(
            [str(Path(sys.executable).with_name(name)), "--help"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert "--namespace" in proc.stdout
        assert proc.stdout.startswith(f"usage: {name} "), "its usage names the command that was run"
        module = points[name].value.partition(":")[0]
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.stdout.startswith(f"usage: python -m {module}"), proc.stdout[:200]


def test_airflow_providers_list_shows_the_package() -> None:
    airflow_cli = Path(sys.executable).with_name("airflow")
    command = [str(airflow_cli)] if airflow_cli.exists() else [sys.executable, "-m", "airflow"]
    proc = subprocess.run(
        [*command, "providers", "list", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # Airflow may log a line before the table; the JSON table is the line that starts with "[{".
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("[{")))
    ours = [row for row in rows if row["package_name"] == DIST]
    assert len(ours) == 1, [row["package_name"] for row in rows]
    assert ours[0]["version"] == airflow_provider_torchelastic.__version__


def test_quickstart_takes_its_image_from_the_airflow_option() -> None:
    code = """
        from pathlib import Path
        from airflow.dag_processing.dagbag import BundleDagBag
        bag = BundleDagBag(dag_folder="example_dags", bundle_path=Path("example_dags").resolve(), safe_mode=False)
        print(bag.import_errors)
        pod = bag.dags["torch_elastic_quickstart"].get_task("train").render_manifests()[1]
        print(pod["spec"]["containers"][0]["image"])
    """
    # The DAG file has no image setting of its own (it once read TORCHELASTIC_IMAGE): the option is the one place.
    env = {"AIRFLOW__TORCH_ELASTIC__IMAGE": "cfg.example.com/runner:1", "TORCHELASTIC_IMAGE": "env.example.com/x:1"}
    proc = run_python(code, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-2:] == ["{}", "cfg.example.com/runner:1"]
    unset = {"AIRFLOW__TORCH_ELASTIC__IMAGE": "", "AIRFLOW__TORCH_ELASTIC__EXECUTION": "kubernetes"}
    proc = run_python("import example_dags.torch_elastic_quickstart", env=unset)
    assert proc.returncode != 0 and "AIRFLOW__TORCH_ELASTIC__IMAGE" in proc.stderr, proc.stderr
    local = {"AIRFLOW__TORCH_ELASTIC__IMAGE": "", "AIRFLOW__TORCH_ELASTIC__EXECUTION": "local"}
    assert run_python("import example_dags.torch_elastic_quickstart", env=local).returncode == 0


def test_task_decorator_resolves() -> None:
    from airflow.sdk import task

    from airflow_provider_torchelastic.decorators import torch_elastic_task

    assert task.torch_elastic is torch_elastic_task


# --- operator construction errors ---------------------------------------------------------------------------------


def train() -> int:
    return 1


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        (
            {"execution": "cloud"},
            ValueError,
            r"execution: expected 'kubernetes' or 'local' \(or None for \[torch_elastic\] execution\), got 'cloud'",
        ),
        ({"python_callable": "train"}, TypeError, r"python_callable: expected a callable, got 'train'"),
        (
            {"task_config": {"nnodes": 2}},
            TypeError,
            r"task_config: expected Elastic\(\.\.\.\) or PyTorch\(\.\.\.\), got \{'nnodes': 2\}",
        ),
        (
            {"task_config": config.Master()},
            TypeError,
            r"task_config: expected Elastic\(\.\.\.\) or PyTorch\(\.\.\.\), got Master\(",
        ),
    ],
    ids=["execution", "callable", "task-config-dict", "task-config-master"],
)
def test_operator_construction_errors(kwargs: dict, exc: type[Exception], pattern: str) -> None:
    from airflow_provider_torchelastic import TorchElasticOperator

    with pytest.raises(exc, match=pattern):
        TorchElasticOperator(**{"task_id": "train", "python_callable": train, **kwargs})


def test_operator_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_torchelastic import Elastic, TorchElasticOperator

    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__IMAGE", "registry.example.com/ml/torchelastic-runner:0.1.0")
    op = TorchElasticOperator(task_id="train", python_callable=train, op_args=(1,), op_kwargs={"a": 2})
    assert op.task_config == Elastic() and op.execution is None
    assert (op.op_args, op.op_kwargs) == ([1], {"a": 2})
    assert set(op.template_fields) >= {"op_args", "op_kwargs"}


@pytest.mark.parametrize(
    ("env_value", "expected"), [(None, "kubernetes"), ("local", "local"), ("kubernetes", "kubernetes")]
)
def test_execution_defaults_to_the_airflow_option(
    monkeypatch: pytest.MonkeyPatch, env_value: str | None, expected: str
) -> None:
    from airflow_provider_torchelastic import TorchElasticOperator

    if env_value is None:
        monkeypatch.delenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", raising=False)
    else:
        monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", env_value)
    op = TorchElasticOperator(task_id="train", python_callable=train, execution="local")
    assert op.resolve_execution() == "local", "an explicit execution wins over the option"
    op.execution = None
    assert op.resolve_execution() == expected


def test_bad_execution_option_is_a_clear_task_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_torchelastic import TorchElasticOperator

    monkeypatch.setenv("AIRFLOW__TORCH_ELASTIC__EXECUTION", "cloud")
    op = TorchElasticOperator(task_id="train", python_callable=train, execution="local")
    op.execution = None
    with pytest.raises(AirflowFailException, match=r"\[torch_elastic\] execution: expected .*got 'cloud'") as info:
        op.resolve_execution()
    assert "AIRFLOW__TORCH_ELASTIC__EXECUTION" in str(info.value)
