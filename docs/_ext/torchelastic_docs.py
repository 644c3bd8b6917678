"""The reference pages that are generated from the code, and the cross-reference rule for this package's own names.

Each ``generate_*`` function returns one Markdown page (MyST) built from what the code declares, never from a copy:

- :func:`generate_configuration`: the ``[torch_elastic]`` options, from the one table in
  ``airflow_provider_torchelastic/options.py``;
- :func:`generate_python_api`: the public names, from the package's ``__all__`` and each public module's ``__all__``
  (autodoc renders their docstrings), each object documented once, at the path users import it from;
- :func:`generate_cli`: the console scripts of pyproject.toml, and the runner, with their ``--help``;
- :func:`generate_exceptions`: the exception tree drawn in ``errors.py``'s docstring, and the exit codes;
- :func:`generate_xcom` and :func:`generate_labels`: the XCom keys and the Kubernetes labels and annotations, their
  values read from the constants that the code uses.

The functions need neither Sphinx nor a build (tests/unit/test_docs.py calls them); :func:`setup` writes the pages
under ``docs/_generated/`` (git-ignored) when a build starts, and the reference pages include them.

References to this package's names must resolve (``nitpicky``): a name documented in the API reference links there
(also when the docstring names it by an internal path: the object is the same); a name that exists in the package
but is not public (an internal module, a helper) is shown as code, after checking that it exists; a name that no
longer exists (a module that moved) stays a warning, which fails the build.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = "airflow_provider_torchelastic"
REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED = Path(__file__).resolve().parents[1] / "_generated"

#: The modules users import from, in the order the API reference shows them: the package root, then each public
#: module (tests/unit/test_public_surface.py pins the same set; tests/unit/test_docs.py checks both agree).
PUBLIC_MODULES: tuple[tuple[str, str], ...] = (
    (PACKAGE, "The package: configuration types, the operator, the training function's helpers."),
    (f"{PACKAGE}.operators", "The operator, its failure classes (one per cause) and `retry_policy` rules."),
    (f"{PACKAGE}.decorators", "`@task.torch_elastic`."),
    (f"{PACKAGE}.pod", "Pod and job options, and env values from Secrets and ConfigMaps."),
    (f"{PACKAGE}.context", "Where a worker is: the task instance, its rank, its checkpoint location."),
    (f"{PACKAGE}.checkpoint", "Checkpoints that survive retries, restarts and preemption."),
    (f"{PACKAGE}.metrics", "Training metrics for the task log and the UI."),
    (f"{PACKAGE}.artifacts", "Tensors, arrays, state dicts and models between tasks."),
    (f"{PACKAGE}.errors", "Exit codes, `RecoverableError` and the Kubernetes API error."),
    (f"{PACKAGE}.triggers", "The deferrable trigger."),
    (f"{PACKAGE}.plugin", "The Airflow UI plugin."),
    (f"{PACKAGE}.preflight", "What a cluster can run, from Python or the command line."),
    (f"{PACKAGE}.kubernetes.sweep", "The backstop that deletes jobs running past their deadline or lease."),
)

#: Console scripts come from pyproject.toml; the runner is a module every pod runs (``python -m``).
RUNNER_MODULE = f"{PACKAGE}.runner"


def _import(path: str) -> Any:
    """``a.b.C`` as Python resolves it: the longest importable module, then attributes; raises LookupError."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            value: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                value = getattr(value, attribute)
        except AttributeError:
            break
        return value
    raise LookupError(path)


# --- configuration ------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def generate_configuration() -> str:
    from airflow_provider_torchelastic import options

    lines = [
        "<!-- Generated from airflow_provider_torchelastic/options.py by docs/_ext/torchelastic_docs.py. -->",
        "",
        f"Section `[{options.SECTION}]`, {len(options.OPTIONS)} options. Each is also an environment variable,",
        f"`AIRFLOW__{options.SECTION.upper()}__<OPTION>`, as every Airflow option is.",
        "",
        "| option | type | default | environment variable |",
        "|---|---|---|---|",
    ]
    for option in options.OPTIONS:
        default = f"`{option.default}`" if option.default else "empty"
        env = f"AIRFLOW__{options.SECTION.upper()}__{option.name.upper()}"
        lines.append(f"| [`{option.name}`](#option-{option.name}) | {option.type} | {default} | `{env}` |")
    for option in options.OPTIONS:
        default = f"`{option.default}`" if option.default else "empty"
        lines += [
            "",
            f"(option-{option.name})=",
            f"## `{option.name}`",
            "",
            _cell(option.description),
            "",
            f"- type: {option.type}; default: {default}; since {option.version_added}",
            f"- example: `{option.example}`",
            f"- environment variable: `AIRFLOW__{options.SECTION.upper()}__{option.name.upper()}`",
        ]
    return "\n".join(lines) + "\n"


# --- the Python API -----------------------------------------------------------------------------------------------


def public_objects() -> Iterator[tuple[str, str, Any]]:
    """``(module, name, value)`` for every public name, in the reference's order (modules themselves included)."""
    for module_name, _ in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            yield module_name, name, getattr(module, name)


def _canonical_paths() -> dict[int, str]:
    """Each public object's one documented path: where its ``__module__`` says it lives if that is a public module
    that gives it under its name, else the first public module that gives it."""
    public = {module for module, _ in PUBLIC_MODULES}
    canonical: dict[int, str] = {}
    for module_name, name, value in public_objects():
        if inspect.ismodule(value) or not (inspect.isclass(value) or callable(value)):
            continue
        home = getattr(value, "__module__", None)
        if home in public and getattr(importlib.import_module(home), name, None) is value:
            canonical[id(value)] = f"{home}.{name}"
        canonical.setdefault(id(value), f"{module_name}.{name}")
    return canonical


def _directive(value: Any) -> str:
    if inspect.isclass(value) and issubclass(value, BaseException):
        return "autoexception"
    if inspect.isclass(value):
        return "autoclass"
    if callable(value):
        return "autofunction"
    return "autodata"


def generate_python_api() -> str:
    canonical = _canonical_paths()
    lines = [
        "<!-- Generated from the package's __all__ and its public modules' by docs/_ext/torchelastic_docs.py. -->",
        "",
    ]
    for module_name, summary in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        lines += ["", f"## `{module_name}`", "", summary, ""]
        # autodoc writes reStructuredText: each module's part is one eval-rst block.
        rst = [f".. py:module:: {module_name}", ""]
        aliases: list[str] = []
        submodules: list[str] = []
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            path = f"{module_name}.{name}"
            if inspect.ismodule(value):
                submodules.append(f"- `{name}`: {{py:mod}}`{_public_module_of(value)}`")
                continue
            home = canonical.get(id(value))
            if home is not None and home != path:
                aliases.append(f"- `{name}`: the same object as {{py:obj}}`{home}`")
                continue
            rst.append(f".. {_directive(value)}:: {path}")
            if inspect.isclass(value):
                rst += ["   :members:", "   :show-inheritance:"]
                if issubclass(value, BaseException):
                    # Exception's own members (args, with_traceback) are Python's, not ours.
                    rst.append("   :exclude-members: with_traceback, add_note, args")
            rst.append("")
        if submodules:
            lines += ["Modules given here:", "", *submodules, ""]
        lines += ["```{eval-rst}", *rst, "```"]
        if aliases:
            lines += ["", "Also given here:", "", *aliases]
    return "\n".join(lines) + "\n"


def _public_module_of(module: Any) -> str:
    """The public path of a module the root gives as an attribute (``checkpoint`` is worker.checkpoint)."""
    for public, _ in PUBLIC_MODULES:
        if importlib.import_module(public) is module:
            return public
    return str(module.__name__)


# --- the command line ---------------------------------------------------------------------------------------------


def console_scripts() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]``: name -> ``module:function``."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as file:
        return dict(tomllib.load(file)["project"]["scripts"])


def _help(module: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=REPO_ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} --help exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout.rstrip()


def generate_cli() -> str:
    lines = [
        "<!-- Generated from pyproject.toml's [project.scripts] and each tool's --help, by",
        "     docs/_ext/torchelastic_docs.py. -->",
    ]
    for name, target in console_scripts().items():
        module = target.split(":")[0]
        lines += [
            "",
            f"## `{name}`",
            "",
            f"The console script `{name}` runs `{target}`; `python -m {module}` is the same.",
            "",
            "```text",
            _help(module),
            "```",
        ]
    lines += [
        "",
        "## The runner",
        "",
        f"Every pod, and every node of local execution, runs `python -m {RUNNER_MODULE}` (no console script: the",
        "provider renders its command line). Its exit codes are in [Exceptions and exit codes](exceptions.md).",
        "",
        "```text",
        _help(RUNNER_MODULE),
        "```",
    ]
    return "\n".join(lines) + "\n"


# --- exceptions and exit codes ------------------------------------------------------------------------------------

_TREE_LINE = re.compile(r"^[\s│├└─]*([A-Z]\w+)\s+\(([\w. ;]+?)[;)]")


def exception_tree() -> str:
    """The tree drawn in errors.py's docstring (the ``::`` block), as it is there."""
    from airflow_provider_torchelastic import errors

    doc = inspect.getdoc(errors) or ""
    _, _, rest = doc.partition("::\n")
    block = []
    for line in rest.splitlines():
        if line and not line.startswith(" "):
            break
        block.append(line[4:] if line.startswith("    ") else line)
    return "\n".join(block).strip("\n")


def exception_classes() -> list[tuple[str, str]]:
    """``(class name, where)`` for each of the package's classes in the tree (``here`` is errors; Airflow's and
    Python's own classes are left out)."""
    found = []
    for line in exception_tree().splitlines():
        match = _TREE_LINE.match(line)
        if match is None:
            continue
        name, where = match.group(1), match.group(2).split(";")[0].strip()
        if where == "Airflow":
            continue
        module = f"{PACKAGE}.errors" if where == "here" else f"{PACKAGE}.{where}"
        found.append((name, module))
    return found


def generate_exceptions() -> str:
    from airflow_provider_torchelastic import errors

    canonical = _canonical_paths()
    lines = [
        "<!-- Generated from airflow_provider_torchelastic/errors.py by docs/_ext/torchelastic_docs.py. -->",
        "",
        "## The exception tree",
        "",
        "Every exception the package defines, as `errors.py` draws it (`here` is `errors`):",
        "",
        "```text",
        exception_tree(),
        "```",
        "",
        "| class | import it from |",
        "|---|---|",
    ]
    for name, module in exception_classes():
        value = _import(f"{module}.{name}")
        home = canonical.get(id(value))
        where = f"{{py:exc}}`~{home}`" if home else f"`{module}.{name}` (internal: raised, not imported)"
        lines.append(f"| `{name}` | {where} |")
    lines += [
        "",
        "## Exit codes",
        "",
        "The runner's (`python -m airflow_provider_torchelastic.runner`), which each pod's container ends with:",
        "",
        "| code | constant | meaning |",
        "|---|---|---|",
    ]
    source = inspect.getsource(errors)
    for constant in ("EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_RECOVERABLE"):
        value = getattr(errors, constant)
        comment = re.search(rf"((?:^#:.*\n)+)^{constant}:", source, flags=re.MULTILINE)
        meaning = " ".join(part.strip()[2:].strip() for part in comment.group(1).splitlines()) if comment else ""
        meaning = re.sub(r":class:`(\w+)`", r"`\1`", meaning)
        lines.append(f"| `{value}` | {{py:data}}`~{PACKAGE}.errors.{constant}` | {_cell(meaning)} |")
    lines.append(
        "| `128+N` | | the runner was stopped by signal N (a deleted pod, a drained node); it writes no failure "
        "report, so it is never taken for the root cause |"
    )
    lines += [
        "",
        "The command line tools exit `0` when all is well, `1` when something is missing or failed, and `2` for bad",
        "usage (see [Command line](cli.md)).",
    ]
    return "\n".join(lines) + "\n"


# --- XCom keys ----------------------------------------------------------------------------------------------------

#: (constant's path, what the value under it is). The key itself is read from the constant.
XCOM_KEYS: tuple[tuple[str, str], ...] = (
    (
        f"{PACKAGE}.core.summary.XCOM_KEY",
        "the job summary, saved when the job ends (also on failure): pods, ranks, reasons, log tails, downsampled "
        "metrics, artifacts. The UI shows finished jobs from it.",
    ),
    (
        f"{PACKAGE}.operators.links.XCOM_JOB_NAME",
        "the Kubernetes job's name, pushed before the task defers (the extra links and the UI read it).",
    ),
    (f"{PACKAGE}.operators.links.XCOM_JOB_NAMESPACE", "the job's namespace (`_local` for local execution in the UI)."),
    (f"{PACKAGE}.operators.links.XCOM_JOB_KIND", "the kind that ran the task: `Pod`, `PyTorchJob` or `TrainJob`."),
    (
        f"{PACKAGE}.operators.backends.kubernetes.XCOM_MANIFESTS",
        "the submitted manifests, the payload elided and sensitive env values masked.",
    ),
)


def generate_xcom() -> str:
    lines = [
        "<!-- Generated by docs/_ext/torchelastic_docs.py: each key is read from the constant the code pushes. -->",
        "",
        "| key | pushed by | holds |",
        "|---|---|---|",
        "| `return_value` | every task | rank 0's value, as strict JSON "
        "([results](../guides/results-and-artifacts.md)) |",
    ]
    for path, meaning in XCOM_KEYS:
        lines.append(f"| `{_import(path)}` | {_who(path)} | {meaning} |")
    return "\n".join(lines) + "\n"


def _who(path: str) -> str:
    return "every task" if path.endswith("summary.XCOM_KEY") else "Kubernetes tasks"


# --- labels and annotations ---------------------------------------------------------------------------------------

#: (constant's path, label or annotation, what it says). Values are read from the constants.
LABELS: tuple[tuple[str, str, str], ...] = (
    (
        f"{PACKAGE}.core.naming.LABEL_MANAGED_BY",
        "label",
        "`airflow-provider-torchelastic` on every object the "
        "provider creates: what the sweep, the shared watch and the UI select by",
    ),
    (f"{PACKAGE}.core.naming.LABEL_DAG_ID", "label and annotation", "the DAG id (the label cut to a valid value)"),
    (f"{PACKAGE}.core.naming.LABEL_TASK_ID", "label and annotation", "the task id"),
    (f"{PACKAGE}.core.naming.LABEL_RUN_ID", "label and annotation", "the DAG run id"),
    (f"{PACKAGE}.core.naming.LABEL_MAP_INDEX", "label", "the map index (`-1` for an unmapped task)"),
    (f"{PACKAGE}.core.naming.LABEL_TRY_NUMBER", "label", "the try number"),
    (
        f"{PACKAGE}.core.naming.LABEL_IDENTITY",
        "label",
        "a hash of the whole identity: one exact selector for a try's objects",
    ),
    (
        f"{PACKAGE}.kubernetes.deadline.NOT_AFTER_LABEL",
        "label",
        "the try's deadline (`execution_timeout`) or its "
        "lease, as a Unix time: the sweep deletes a job still running 5 minutes past it",
    ),
    (
        f"{PACKAGE}.kubernetes.submit.TOKEN_ANNOTATION",
        "annotation",
        "the try's random token, on the payload Secret and the job: a try re-attaches only to objects that carry it",
    ),
    (
        f"{PACKAGE}.kubernetes.status.KUEUE_QUEUE_LABEL",
        "label (yours)",
        "Kueue's LocalQueue: set it with `PodOptions(labels=...)`; the provider then waits for admission as queued",
    ),
    (
        f"{PACKAGE}.core.naming.REPLICA_TYPE_LABEL",
        "label (read)",
        "set by the training operator on a PyTorchJob's pods: master or worker",
    ),
    (f"{PACKAGE}.core.naming.REPLICA_INDEX_LABEL", "label (read)", "set by the training operator: the replica index"),
    (
        f"{PACKAGE}.kubernetes.kinds.pytorchjob.POD_LABEL",
        "label (read)",
        "set by the training operator: the PyTorchJob's name",
    ),
)


def generate_labels() -> str:
    from airflow_provider_torchelastic.core import naming

    lines = [
        "<!-- Generated by docs/_ext/torchelastic_docs.py: each key is read from the constant the code uses. -->",
        "",
        f"Every key the provider sets is under the prefix `{naming.LABEL_PREFIX}`, except the standard",
        f"`{naming.LABEL_MANAGED_BY}`.",
        "",
        "| key | kind | what it says |",
        "|---|---|---|",
    ]
    for path, kind, meaning in LABELS:
        lines.append(f"| `{_import(path)}` | {kind} | {meaning} |")
    described = {_import(path) for path, _, _ in LABELS}
    others = sorted(
        value
        for name, value in vars(naming).items()
        if name.startswith(("LABEL_", "ANNOTATION_")) and name != "LABEL_PREFIX" and value not in described
    )
    for value in others:
        lines.append(f"| `{value}` | label or annotation | set by the provider (see `core/naming.py`) |")
    return "\n".join(lines) + "\n"


PAGES = {
    "configuration.md": generate_configuration,
    "python-api.md": generate_python_api,
    "cli.md": generate_cli,
    "exceptions.md": generate_exceptions,
    "xcom.md": generate_xcom,
    "labels.md": generate_labels,
}


def write_pages(folder: Path = GENERATED) -> None:
    """Write every generated page; a page whose text did not change is left alone (so Sphinx does not re-read it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, generate in PAGES.items():
        path = folder / name
        text = generate()
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


# --- Sphinx -------------------------------------------------------------------------------------------------------


def _documented(app: Any) -> dict[int, tuple[str, str, str]]:
    """id(object) -> (full name, docname, anchor) of every Python object the build documents."""
    cached = getattr(app.env, "_torchelastic_documented", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    found: dict[int, tuple[str, str, str]] = {}
    domain = app.env.domains["py"]
    for name, entry in domain.objects.items():
        if entry.aliased or not name.startswith(PACKAGE):
            continue
        try:
            value = _import(name)
        except LookupError:
            continue
        if inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value):
            found.setdefault(id(value), (name, entry.docname, entry.node_id))
    app.env._torchelastic_documented = found
    return found


def _candidates(node: Any) -> list[str]:
    target = node["reftarget"].lstrip(".~")
    module = node.get("py:module") or ""
    klass = node.get("py:class") or ""
    names = [target]
    if module:
        names += [f"{module}.{klass}.{target}" if klass else "", f"{module}.{target}"]
        # A relative ``.operator`` in a package's docstring names a submodule of that package.
        names.append(f"{module}.{target}")
        parent = module.rpartition(".")[0]
        if parent:
            names.append(f"{parent}.{target}")
    names.append(f"{PACKAGE}.{target}")
    # ``dcp_safe.CheckpointMetadataError`` names a module by its last part(s); a bare ``Settings`` is a type a
    # signature names through an ``if TYPE_CHECKING:`` import. Both are looked up among the package's modules.
    head, dot, rest = target.partition(".")
    for loaded in sorted(name for name in sys.modules if name.startswith(PACKAGE)):
        if dot and loaded.endswith(f".{head}"):
            names.append(f"{loaded}.{rest}")
        elif not dot and target[:1].isupper() and target in vars(sys.modules[loaded]):
            names.append(f"{loaded}.{target}")
    return [name for name in names if name]


def _resolve_own_name(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """missing-reference: a name of this package that exists links to where it is documented, or shows as code."""
    if node.get("refdomain") != "py":
        return None
    for name in _candidates(node):
        if not name.startswith(PACKAGE):
            continue
        try:
            value = _import(name)
        except LookupError:
            # An attribute set in __init__ (``TrainingError.pod``) is no class attribute: the class must exist.
            owner, _, attribute = name.rpartition(".")
            try:
                owner_value = _import(owner)
            except LookupError:
                continue
            if not inspect.isclass(owner_value) or attribute not in _instance_attributes(owner_value):
                continue
            return contnode
        documented = _documented(app).get(id(value))
        if documented is not None and not isinstance(value, (str, int, float)):
            from sphinx.util.nodes import make_refnode

            full_name, docname, anchor = documented
            return make_refnode(app.builder, node["refdoc"], docname, anchor, contnode, full_name)
        return contnode
    return None


def _instance_attributes(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=", source))
    return names


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", lambda app: write_pages())
    app.connect("missing-reference", _resolve_own_name)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
