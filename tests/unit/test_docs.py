"""The docs cannot rot quietly: every relative link and repository path in the README and docs/ resolves, every
example a page includes exists, the README stays a front door, and the generated reference lists every option, public
name, exception class and command-line tool.

The Sphinx build itself (warnings as errors, every reference resolved) is ``make docs``, a step of scripts/test.sh;
these checks need no Sphinx and run in about a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
#: The Markdown the site and the repository page show: the README, the changelog, the security policy and docs/.
PAGES = sorted(
    [README, REPO_ROOT / "CHANGELOG.md", REPO_ROOT / "SECURITY.md"]
    + [path for path in DOCS.rglob("*.md") if not {"_build", "_generated"} & set(path.relative_to(DOCS).parts)]
)
#: Top-level folders of the repository: a backticked path starting with one of them names a file or folder here.
REPO_FOLDERS = (
    "airflow_provider_torchelastic/",
    "benchmarks/",
    "deploy/",
    "docker/",
    "docs/",
    "example_dags/",
    "scripts/",
    "tests/",
    "ui/",
)


@cache
def extension() -> ModuleType:
    """docs/_ext/torchelastic_docs.py, which generates the reference pages (it imports Sphinx only in setup())."""
    spec = importlib.util.spec_from_file_location("torchelastic_docs", DOCS / "_ext" / "torchelastic_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)


def links(page: Path) -> Iterator[str]:
    """Relative targets of the page's Markdown links and images (no URL, no in-page anchor)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(page.read_text())):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
            yield target


def included_files(page: Path) -> Iterator[str]:
    """The files a page includes (``literalinclude`` and ``include`` directives)."""
    yield from re.findall(r"^```\{(?:literalinclude|include)\}\s+(\S+)", page.read_text(), flags=re.MULTILINE)


def repository_paths(page: Path) -> Iterator[str]:
    """Backticked paths under a top-level folder of the repository (`deploy/rbac.yaml`, `tests/e2e/`)."""
    for text in re.findall(r"`([^`\s]+)`", page.read_text()):
        path = text.split("::")[0].split(":")[0].rstrip(".,")
        if path.startswith(REPO_FOLDERS) and not re.search(r"[{}<>*$]", path):
            yield path


def _cases(collect) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(str(page.relative_to(REPO_ROOT)), target) for page in PAGES for target in collect(page)]


LINKS = _cases(links)
INCLUDES = _cases(included_files)
PATHS = _cases(repository_paths)


def test_the_pages_name_links_includes_and_paths() -> None:
    assert len(PAGES) >= 20 and len(LINKS) >= 50 and len(INCLUDES) >= 20 and len(PATHS) >= 30


@pytest.mark.parametrize(("page", "target"), LINKS)
def test_every_relative_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (REPO_ROOT / page).parent / path
    assert resolved.exists(), f"{page} links to {target}, which does not exist"
    if anchor and resolved.suffix == ".md":
        headings = re.findall(r"^#{1,3} (.+)$", _without_code_blocks(resolved.read_text()), flags=re.MULTILINE)
        assert anchor in {_slug(heading) for heading in headings}, f"{page}: no heading #{anchor} in {path}"


def _slug(heading: str) -> str:
    """The anchor MyST (and GitHub) give a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(("page", "target"), INCLUDES)
def test_every_included_file_exists(page: str, target: str) -> None:
    if "_generated/" in target:  # written by docs/_ext at the start of every build
        assert Path(target).name in extension().PAGES, f"{page} includes {target}, which no generator writes"
    else:
        assert ((REPO_ROOT / page).parent / target).exists(), f"{page} includes {target}, which does not exist"


@pytest.mark.parametrize(("page", "path"), PATHS)
def test_every_repository_path_exists(page: str, path: str) -> None:
    assert (REPO_ROOT / path).exists(), f"{page} names {path}, which does not exist"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"the README has {len(lines)} lines: move detail into docs/"
    assert any("pip install airflow-provider-torchelastic" in line for line in lines[:80])
    assert any("make demo" in line for line in lines[:40]) and any("make test" in line for line in lines[:40])


def test_the_ui_screenshots_the_readme_and_docs_show_exist() -> None:
    shown = {target for _, target in LINKS if target.endswith(".png")}
    assert any("ui-training-jobs.png" in target for target in shown), shown


# --- the generated reference ---------------------------------------------------------------------------------------


def test_the_configuration_reference_lists_every_option_with_its_default() -> None:
    from airflow_provider_torchelastic import options

    page = extension().generate_configuration()
    rows = dict(re.findall(r"^\| \[`([a-z_]+)`\]\(#option-[a-z_]+\) \| \w+ \| ([^|]+?) \|", page, flags=re.MULTILINE))
    declared = {option.name: f"`{option.default}`" if option.default else "empty" for option in options.OPTIONS}
    assert rows == declared
    for option in options.OPTIONS:
        assert f"## `{option.name}`" in page and option.description.replace("|", "\\|") in page


def test_the_api_reference_documents_every_public_name() -> None:
    page = extension().generate_python_api()
    for module, name, _ in extension().public_objects():
        # autodoc'd at this path, or listed as the same object as the one documented at its home path
        assert f":: {module}.{name}\n" in page or f"- `{name}`: " in page, f"{module}.{name} is not in the reference"


def test_the_api_reference_covers_the_pinned_public_modules() -> None:
    from tests.unit import test_public_surface

    documented = {module for module, _ in extension().PUBLIC_MODULES}
    assert documented >= test_public_surface.PUBLIC_MODULES


def test_the_exceptions_reference_names_every_exception_class_of_the_package() -> None:
    import airflow_provider_torchelastic

    page = extension().generate_exceptions()
    drawn = {name for name, _ in extension().exception_classes()}
    assert len(drawn) >= 25
    for name, module in extension().exception_classes():
        assert isinstance(getattr(importlib.import_module(module), name), type), f"{module}.{name}"
        assert f"| `{name}` |" in page
    # Every exception class the public modules give is drawn in the tree.
    for module, name, value in extension().public_objects():
        if isinstance(value, type) and issubclass(value, BaseException):
            assert name in drawn, f"{module}.{name} is not drawn in errors.py's tree"
    for constant in ("EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_RECOVERABLE"):
        assert f"| `{getattr(airflow_provider_torchelastic.errors, constant)}` |" in page


def test_the_command_line_reference_shows_every_console_script() -> None:
    page = extension().generate_cli()
    scripts = extension().console_scripts()
    assert set(scripts) == {"torchelastic-preflight", "torchelastic-sweep"}
    for name in scripts:
        assert f"## `{name}`" in page
    assert page.count("usage: python -m airflow_provider_torchelastic.") == len(scripts) + 1  # and the runner


def test_the_xcom_and_label_references_read_their_keys_from_the_code() -> None:
    from airflow_provider_torchelastic.core import naming, summary

    assert f"| `{summary.XCOM_KEY}` |" in extension().generate_xcom()
    labels = extension().generate_labels()
    for key in (naming.LABEL_MANAGED_BY, naming.LABEL_DAG_ID, naming.LABEL_IDENTITY):
        assert f"| `{key}` |" in labels


def test_the_readmes_new_verb_example_is_the_code() -> None:
    """The development section quotes a request builder: it must be the one in kubernetes/calls.py, as it is."""
    import inspect

    from airflow_provider_torchelastic.kubernetes import calls

    text = README.read_text()
    start = text.index("# kubernetes/calls.py: pure, testable without a cluster\n")
    quoted = text[start : text.index("\n\n\n# the call site", start)].split("\n", 1)[1]
    assert quoted.strip() == inspect.getsource(calls.events).strip()
