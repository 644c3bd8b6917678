"""The ``[torch_elastic]`` options are declared once (options.py) and that table is the truth everywhere: every option
the package reads is declared and every declared option is read (read from the source, so a new read cannot slip in
beside the table), Airflow's provider info is the table, and each default parses as its type. The docs'
configuration reference is generated from the table (tests/unit/test_docs.py checks it lists every option)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import airflow_provider_torchelastic
from airflow_provider_torchelastic import options, settings
from airflow_provider_torchelastic.core.choices import EXECUTIONS
from airflow_provider_torchelastic.core.metrics_format import DEFAULT_INTERVAL
from airflow_provider_torchelastic.kubernetes.kinds import JOB_KIND_CHOICES

PACKAGE_DIR = Path(airflow_provider_torchelastic.__file__).parent
SETTINGS = PACKAGE_DIR / "settings.py"
DECLARED = {option.name for option in options.OPTIONS}
ENV = "AIRFLOW__TORCH_ELASTIC__"


# --- the source: which options the package reads --------------------------------------------------------------------


@dataclass(frozen=True)
class _Read:
    """A call that reads an option: where it is, and the option's name (None where the source does not say it)."""

    where: str
    name: str | None


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "static" not in path.parts:
            yield path, ast.parse(path.read_text(), filename=str(path))


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """A module's names bound to a string at module level (``IMAGE_OPTION: Final = "image"``), and ``SECTION`` where
    it comes from the table (settings imports it so)."""
    found = {"SECTION": options.SECTION}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.update({target.id: value.value for target in targets if isinstance(target, ast.Name)})
    return found


def _string(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _callee(call: ast.Call) -> str:
    return (
        call.func.id
        if isinstance(call.func, ast.Name)
        else call.func.attr
        if isinstance(call.func, ast.Attribute)
        else ""
    )


def _functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.Call]]:
    """Each call with the function it is in (module-level calls have no function and are not yielded)."""
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    yield function, node


def _first_parameter(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    arguments = [*function.args.posonlyargs, *function.args.args]
    return arguments[0].arg if arguments else None


def _readers() -> frozenset[str]:
    """settings.py's functions that read the option their first parameter names: ``_get``, the one that reads, and
    every function that hands its parameter on to a reader (``_text``, ``_boolean``, ``url_template``...)."""
    tree = ast.parse(SETTINGS.read_text())
    readers = {"_get"}
    while True:
        more = {
            function.name
            for function, call in _functions(tree)
            if _callee(call) in readers
            and call.args
            and isinstance(call.args[0], ast.Name)
            and call.args[0].id == _first_parameter(function)
        }
        if more <= readers:
            return frozenset(readers)
        readers |= more


READERS = _readers()


def _is_section_read(call: ast.Call, constants: dict[str, str]) -> bool:
    """``conf.get*("torch_elastic", ...)``, by whatever name the configuration is reached."""
    return (
        isinstance(call.func, ast.Attribute)
        and call.func.attr.startswith("get")
        and bool(call.args)
        and _string(call.args[0], constants) == options.SECTION
    )


def _reads() -> list[_Read]:
    reads: list[_Read] = []
    for path, tree in _sources():
        constants = _string_constants(tree)
        in_settings = path == SETTINGS
        for function, call in _functions(tree):
            where = f"{path.relative_to(PACKAGE_DIR.parent)}:{call.lineno} ({function.name})"
            forwarded = (
                in_settings
                and function.name in READERS
                and bool(call.args)
                and isinstance(call.args[0], ast.Name)
                and call.args[0].id == _first_parameter(function)
            )
            if _is_section_read(call, constants):
                name_node = call.args[1] if len(call.args) > 1 else None
                if (
                    in_settings
                    and function.name == "_get"
                    and isinstance(name_node, ast.Name)
                    and name_node.id == _first_parameter(function)
                ):
                    continue  # the one read of the configuration, of the name _get was given and looked up
                reads.append(
                    _Read(f"{where}: conf.{_callee(call)} outside settings._get", _string(name_node, constants))
                )
                continue
            callee = _callee(call)
            # settings' private readers are read where they live; a public one (url_template) wherever it is called.
            if callee in READERS and (in_settings or not callee.startswith("_")) and not forwarded:
                reads.append(_Read(where, _string(call.args[0], constants) if call.args else None))
    return reads


READS = _reads()


def test_the_configuration_is_read_in_settings_get_alone() -> None:
    # Every read goes through the function that refuses an undeclared name: a conf.get of the section anywhere else
    # would read an option without looking it up in the table.
    outside = [read.where for read in READS if "conf." in read.where]
    assert not outside, f"read [torch_elastic] through a settings function instead: {outside}"
    tree = ast.parse(SETTINGS.read_text())
    gets = [
        call
        for function, call in _functions(tree)
        if function.name == "_get" and _is_section_read(call, _string_constants(tree))
    ]
    assert len(gets) == 1, "settings._get reads the configuration once"


def test_every_read_names_its_option_in_the_source() -> None:
    # A name computed at run time could read anything: pass a literal or a module constant, so that this scan sees it.
    unnamed = [read.where for read in READS if read.name is None]
    assert not unnamed, f"an option read by a name the source does not spell: {unnamed}"
    assert {"_get", "_text", "_boolean", "url_template"} <= READERS, READERS  # the scan found settings' readers


def test_every_option_read_is_declared_and_every_declared_option_is_read() -> None:
    read = {read.name for read in READS if read.name is not None}
    undeclared = sorted(read - DECLARED)
    unread = sorted(DECLARED - read)
    assert not undeclared, f"read but not declared in options.OPTIONS: {undeclared}"
    assert not unread, f"declared in options.OPTIONS but read nowhere (drop it, or read it through settings): {unread}"


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _environment_reads(tree: ast.Module) -> Iterator[ast.expr]:
    """The names that ``os.environ[...]``, ``os.environ.get(...)`` (``pop``, ``setdefault``) and ``os.getenv(...)``
    read from the process environment."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.slice
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            by_method = (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "pop", "setdefault")
                and _is_environ(func.value)
            )
            if by_method or _callee(node) == "getenv":
                yield node.args[0]


def _starts_like_an_option_variable(node: ast.expr) -> bool:
    first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
    return isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("AIRFLOW__")


def test_no_option_is_read_from_the_environment_around_airflow() -> None:
    # AIRFLOW__TORCH_ELASTIC__* read by hand would skip the table and Airflow's other sources (airflow.cfg, secrets
    # backends): Airflow's configuration reads the environment for us, through settings._get.
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{getattr(node, 'lineno', '?')}"
        for path, tree in _sources()
        for node in _environment_reads(tree)
        if _starts_like_an_option_variable(node)
    ]
    assert not found, f"read the option through settings instead: {found}"


def test_reading_an_undeclared_option_fails_naming_it() -> None:
    with pytest.raises(KeyError, match=r"\[torch_elastic\] no_such_template is not a declared option.*options\.py"):
        settings.url_template("no_such_template")


# --- the table and what is built from it ----------------------------------------------------------------------------


def test_the_provider_info_config_is_the_table() -> None:
    info = airflow_provider_torchelastic.get_provider_info()
    assert info["config"] == options.provider_config()
    section = info["config"]["torch_elastic"]
    assert section["description"] == "Defaults of TorchElasticOperator and @task.torch_elastic."
    assert list(section["options"]) == [option.name for option in options.OPTIONS]
    # What Airflow was told before the table existed, and still is (job_kind added).
    assert {
        "execution", "image", "job_kind", "checkpoint_root", "result_storage", "result_storage_conn_id",
        "result_storage_keep", "result_storage_max_bytes", "artifact_storage", "artifact_storage_conn_id",
        "report_interval", "deferrable", "early_event_hold", "job_lease", "dashboard_url_template",
        "logs_url_template", "ui_kubernetes_conn_id", "retry_memory_max",
    } == DECLARED  # fmt: skip
    assert section["options"]["result_storage_keep"] == {
        "description": "Keep result files in result_storage after they were read (by default they are deleted once "
        "the result is in XCom).",
        "version_added": "0.1.0",
        "type": "boolean",
        "example": "True",
        "default": "False",
    }
    assert section["options"]["result_storage_max_bytes"]["default"] == "1073741824"
    assert section["options"]["result_storage_max_bytes"]["type"] == "integer"
    assert section["options"]["execution"] | {"description": ""} == {
        "description": "",
        "version_added": "0.1.0",
        "type": "string",
        "example": "local",
        "default": "kubernetes",
    }
    assert section["options"]["ui_kubernetes_conn_id"]["default"] == "kubernetes_default"
    assert section["options"]["report_interval"]["type"] == "float"
    assert section["options"]["report_interval"]["default"] == "15"
    assert section["options"]["job_kind"]["default"] == "auto"


def _parses(type_: str, text: str) -> bool:
    try:
        if type_ == "boolean":
            return text in ("True", "False")
        if type_ == "integer":
            int(text)
        elif type_ == "float":
            float(text)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("option", options.OPTIONS, ids=lambda option: option.name)
def test_each_default_and_example_parse_as_the_options_type(option: options.Option) -> None:
    assert _parses(option.type, option.default), f"{option.name}: default {option.default!r} is no {option.type}"
    assert _parses(option.type, option.example), f"{option.name}: example {option.example!r} is no {option.type}"
    assert option.description and option.version_added


def test_an_option_of_an_unknown_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[torch_elastic\] seconds: type expected one of 'string', .*got 'duration'"):
        options.Option(name="seconds", type="duration", default="1", version_added="0.1.0", description="", example="1")


def test_the_defaults_elsewhere_are_the_tables() -> None:
    default = {option.name: option.default for option in options.OPTIONS}
    assert settings.DEFAULT_RESULT_MAX_BYTES == int(default["result_storage_max_bytes"]) == 1 << 30
    assert float(default["early_event_hold"]) == settings.DEFAULT_EARLY_EVENT_HOLD
    assert settings.DEFAULT_JOB_LEASE == float(default["job_lease"]) >= settings.MIN_JOB_LEASE
    # report() falls back to its own interval where none is rendered into the pod: the documented default is that one.
    assert float(default["report_interval"]) == DEFAULT_INTERVAL
    # The choices live in core.choices; the table (standard library only) spells them in its descriptions.
    assert default["execution"] in EXECUTIONS
    description = options.DECLARED["execution"].description
    assert all(f"'{choice}'" in description for choice in EXECUTIONS), description
    # job_kind's choices live with the kinds; the table (standard library only) spells them in its description.
    assert default["job_kind"] in JOB_KIND_CHOICES
    description = options.DECLARED["job_kind"].description
    assert all(f"'{choice}'" in description for choice in JOB_KIND_CHOICES), description


# --- reads that moved into settings keep their behaviour ------------------------------------------------------------


def test_the_ui_connection_defaults_to_kubernetes_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(f"{ENV}UI_KUBERNETES_CONN_ID", raising=False)
    assert settings.read_ui_kubernetes_conn_id() == "kubernetes_default"
    monkeypatch.setenv(f"{ENV}UI_KUBERNETES_CONN_ID", "ui_cluster")
    assert settings.read_ui_kubernetes_conn_id() == "ui_cluster"


def test_the_preflight_reads_the_image_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(f"{ENV}IMAGE", raising=False)
    assert settings.read_image_option() is None
    # The smoke job reports an invalid image as its own failed row: the read does not refuse it.
    monkeypatch.setenv(f"{ENV}IMAGE", "Not An Image")
    assert settings.read_image_option() == "Not An Image"
    with pytest.raises(ValueError, match=r"\[torch_elastic\] image"):
        settings.read_image()


@pytest.mark.parametrize(
    ("raw", "expected"), [("True", True), ("f", False), ("1", True), (" FALSE ", False), ("0 # off", False)]
)
def test_a_boolean_option_takes_airflows_spellings(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv(f"{ENV}DEFERRABLE", raw)
    assert settings.Settings.read(execution="kubernetes").deferrable is expected


def test_a_boolean_option_of_another_spelling_fails_naming_its_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv(f"{ENV}DEFERRABLE", "yes")
    with pytest.raises(
        AirflowFailException, match=rf"deferrable: expected True or False, got 'yes' \(env {ENV}DEFERRABLE\)"
    ):
        settings.Settings.read(execution="kubernetes")
    monkeypatch.delenv(f"{ENV}DEFERRABLE")
    assert settings.Settings.read(execution="kubernetes").deferrable is True  # the declared default
