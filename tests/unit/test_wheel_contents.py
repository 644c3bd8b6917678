"""What a wheel and an sdist built from a clean clone hold: the UI plugin's bundle (built by npm while packaging,
build_ui.py), the entry points, and nothing of the tests or of ui/node_modules.

Built from a copy of the tracked files (never in the working tree, whose bundle a developer may have built), through
the PEP 517 hooks of pyproject.toml's [build-system] in this environment (no build isolation: offline, and the
environment's setuptools meets the requirement, checked below). Needs npm and node, as building a wheel does.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_provider_torchelastic"
STATIC = f"{PACKAGE}/plugin/static"
BUNDLE = f"{STATIC}/torch-elastic.js"
ICON = f"{STATIC}/icon.svg"
WARNING = "WARNING: the UI plugin's bundle"

#: Runs one hook of the backend that [build-system] names, in the project directory (its cwd), as a frontend does.
HOOK = """
import importlib, sys, tomllib
with open("pyproject.toml", "rb") as f:
    system = tomllib.load(f)["build-system"]
sys.path[:0] = system.get("backend-path", [])
getattr(importlib.import_module(system["build-backend"]), sys.argv[1])(sys.argv[2])
"""


def tracked_copy(dest: Path) -> Path:
    """The tracked files as they are in the working tree: what a clone of the next commit holds."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # deleted in the working tree: not in the next commit either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build(project: Path, hook: str, out: Path, *, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path} if path is not None else None
    return subprocess.run(
        [sys.executable, "-c", HOOK, hook, str(out)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def built(project: Path, hook: str, out: Path, suffix: str = ".whl", *, path: str | None = None) -> Path:
    done = build(project, hook, out, path=path)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    [artifact] = out.glob(f"*{suffix}")
    return artifact


@pytest.fixture(scope="module")
def npm() -> str:
    found = shutil.which("npm")
    assert found and shutil.which("node"), (
        "building the wheel needs npm and node (the UI bundle is built from ui/): run `make setup`, which installs "
        "them, or apt-get install nodejs npm"
    )
    return found


@pytest.fixture(scope="module")
def artifacts(npm: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A wheel from the clean copy (npm builds the bundle), then an sdist of it (ui/node_modules now there), then a
    wheel from that sdist."""
    tmp = tmp_path_factory.mktemp("dist")
    project = tracked_copy(tmp / "clone")
    assert not (project / STATIC).exists(), "the bundle is git-ignored: a clean clone has none"
    wheel = built(project, "build_wheel", tmp / "wheel")
    assert (project / "ui" / "node_modules").is_dir()
    sdist = built(project, "build_sdist", tmp / "sdist", ".tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "unpacked", filter="data")
    [unpacked] = (tmp / "unpacked").iterdir()
    from_sdist = built(unpacked, "build_wheel", tmp / "wheel-from-sdist")
    yield {"wheel": wheel, "sdist": sdist, "wheel_from_sdist": from_sdist}


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_environment_meets_the_build_requirements_so_a_build_here_stands_for_an_isolated_one() -> None:
    system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    for requirement in map(Requirement, system["requires"]):
        assert requirement.specifier.contains(version(requirement.name)), requirement


def test_the_wheel_has_the_bundle_the_entry_points_and_no_tests_nor_node_modules(artifacts: dict[str, Path]) -> None:
    names = wheel_names(artifacts["wheel"])
    with zipfile.ZipFile(artifacts["wheel"]) as zf:
        bundle = zf.read(BUNDLE).decode()
        assert b"<svg" in zf.read(ICON)
        [entry_points_txt] = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(entry_points_txt).decode())
    # The components that the plugin's react_apps name, defined by the bundle on globalThis.
    assert '"Training jobs"' in bundle and '"Training job"' in bundle, bundle[:300]
    assert dict(entry_points["airflow.plugins"]) == {"torch_elastic": f"{PACKAGE}.plugin:TorchElasticPlugin"}
    assert dict(entry_points["apache_airflow_provider"]) == {"provider_info": f"{PACKAGE}:get_provider_info"}
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {PACKAGE}
    assert {n for n in names if n.startswith(f"{STATIC}/")} == {BUNDLE, ICON}
    assert not [n for n in names if "node_modules" in n or n.startswith(("tests/", "ui/")) or "build_ui" in n]


def test_the_sdist_has_the_built_bundle_and_the_ui_sources_and_no_tests_nor_node_modules(
    artifacts: dict[str, Path],
) -> None:
    with tarfile.open(artifacts["sdist"]) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {BUNDLE, ICON, "build_ui.py", "MANIFEST.in", "pyproject.toml"} <= names
    assert {"ui/package.json", "ui/package-lock.json", "ui/build.mjs", "ui/src/index.jsx", "ui/src/icon.svg"} <= names
    assert not [n for n in names if "node_modules" in n or n.startswith("tests/")]


def test_a_wheel_built_from_the_sdist_is_the_same_wheel(artifacts: dict[str, Path]) -> None:
    assert wheel_names(artifacts["wheel_from_sdist"]) == wheel_names(artifacts["wheel"])
    with zipfile.ZipFile(artifacts["wheel_from_sdist"]) as again, zipfile.ZipFile(artifacts["wheel"]) as first:
        assert again.read(BUNDLE) == first.read(BUNDLE)


def test_without_npm_a_wheel_fails_saying_what_to_install_and_an_editable_install_only_warns(tmp_path: Path) -> None:
    project = tracked_copy(tmp_path / "clone")
    no_tools = str(tmp_path / "empty-bin")  # a PATH with neither npm nor node
    os.mkdir(no_tools)

    failed = build(project, "build_wheel", tmp_path / "wheel", path=no_tools)
    assert failed.returncode != 0
    error = failed.stdout + failed.stderr
    assert "is not built, and npm and node" in error and "apt-get install nodejs npm" in error, error[-3000:]
    assert "npm ci && npm run build" in error, error[-3000:]

    warned = build(project, "build_editable", tmp_path / "editable", path=no_tools)
    assert warned.returncode == 0, warned.stdout[-3000:] + warned.stderr[-3000:]
    assert f"{WARNING} ({BUNDLE}) is not built" in warned.stdout

    # A bundle newer than its sources is reused without npm, by an editable install and by a wheel alike.
    static = project / STATIC
    static.mkdir(parents=True)
    (static / "torch-elastic.js").write_text('globalThis["Training jobs"] = () => null;\n')
    (static / "icon.svg").write_text("<svg/>\n")
    quiet = build(project, "build_editable", tmp_path / "editable-again", path=no_tools)
    assert quiet.returncode == 0 and WARNING not in quiet.stdout, quiet.stdout[-3000:]
    assert BUNDLE in wheel_names(built(project, "build_wheel", tmp_path / "reused", path=no_tools))

    # ... but not once a source has changed since: a wheel would ship a stale page.
    source = project / "ui" / "src" / "index.jsx"
    newer = (static / "torch-elastic.js").stat().st_mtime + 10
    os.utime(source, (newer, newer))
    stale = build(project, "build_wheel", tmp_path / "stale", path=no_tools)
    assert stale.returncode != 0 and "is out of date" in stale.stdout + stale.stderr
