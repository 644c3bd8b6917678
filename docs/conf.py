"""Sphinx configuration: MyST (Markdown) pages, the furo theme, reference pages generated from the code.

Built by ``make docs`` (and by ``.ci/run``, through scripts/test.sh) with warnings as errors and nitpicky references.
Nothing is fetched at build time: no intersphinx, no link check, no theme assets from a CDN.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# Importing the package imports Airflow, which writes a default airflow.cfg into AIRFLOW_HOME when there is none: a
# folder of the build's own, so that building the docs leaves nothing in ~/airflow.
os.environ["AIRFLOW_HOME"] = str(DOCS / "_build" / "airflow-home")
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

from airflow_provider_torchelastic import __version__  # noqa: E402

project = "airflow-provider-torchelastic"
author = "The airflow-provider-torchelastic authors"
copyright = "the airflow-provider-torchelastic authors, Apache-2.0"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "torchelastic_docs",  # docs/_ext: the generated reference pages, and the rule for this package's own names
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# _generated holds pages the reference pages include (docs/_ext writes them at the start of every build).
exclude_patterns = ["_build", "_generated", "_ext"]

myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
# Anchors for headings down to ###, so that pages link to sections as [text](page.md#a-heading).
myst_heading_anchors = 3

# --- references ---------------------------------------------------------------------------------------------------
nitpicky = True
# Names that cannot resolve without a network (no intersphinx): Python's standard library and the third-party
# packages the docstrings and signatures name. Only other projects' names are listed; every name of this package
# must resolve (docs/_ext/torchelastic_docs.py links a documented name, shows an existing internal one as code, and
# leaves a name that does not exist as a warning, which fails the build).
_THIRD_PARTY = (
    "airflow",
    "kubernetes",
    "kubernetes_asyncio",
    "torch",
    "numpy",
    "np",
    "fsspec",
    "pendulum",
    "cloudpickle",
    "safetensors",
    "fastapi",
    "starlette",
    "pydantic",
    "yaml",
    "tenacity",
    "urllib3",
    "jinja2",
    "sqlalchemy",
)
_STANDARD_LIBRARY = (
    "abc",
    "argparse",
    "asyncio",
    "collections",
    "concurrent",
    "contextlib",
    "dataclasses",
    "datetime",
    "enum",
    "io",
    "json",
    "logging",
    "os",
    "pathlib",
    "re",
    "signal",
    "subprocess",
    "threading",
    "types",
    "typing",
    "typing_extensions",
    "uuid",
)
_BUILTINS = (
    "None|NoneType|Ellipsis|object|type|int|float|complex|bool|str|bytes|bytearray|dict|list|tuple|set|frozenset|"
    "callable|Callable|Any|Iterable|Iterator|Mapping|Sequence|MutableMapping|AsyncIterator|Generator|"
    "BaseException|Exception|ValueError|TypeError|RuntimeError|PermissionError|FileNotFoundError|OSError|KeyError|"
    "LookupError|SystemExit|TimeoutError|NotImplementedError|Enum|StrEnum|IntEnum|Path|PurePath|timedelta|datetime|"
    "Final|ClassVar|Literal|Optional|Union|Self|TypeVar|Protocol|NamedTuple|TracebackType|ModuleType|"
    "Context|BaseOperator|BaseTrigger|TriggerEvent|AirflowException|AirflowPlugin|BaseOperatorLink|"
    "TaskInstanceKey|ObjectStoragePath|Tensor|Module|ndarray|ExceptionRetryPolicy|RetryRule|RetryAction|"
    "RetryDecision|V1Pod|FastAPI|Request"
)
nitpick_ignore_regex = [
    (r"py:.*", rf"({'|'.join(_THIRD_PARTY + _STANDARD_LIBRARY)})(\..*)?"),
    (r"py:.*", rf"({_BUILTINS})"),
]

# --- autodoc ------------------------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = False
autodoc_inherit_docstrings = False
autodoc_default_options = {"undoc-members": False}

# --- HTML ---------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"airflow-provider-torchelastic {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
