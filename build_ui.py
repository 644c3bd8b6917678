"""Packaging hook: builds the UI plugin's bundle into the package while setuptools builds a wheel, an sdist or an
editable install (the commands are named in pyproject.toml's ``[tool.setuptools.cmdclass]``).

Why: the bundle (``airflow_provider_torchelastic/plugin/static/``: ``torch-elastic.js`` and ``icon.svg``) is built
from ``ui/`` by npm and never committed, so without this a wheel built from a clean clone (``python -m build``,
``pip install git+...``) would ship the plugin without its pages.

- A bundle newer than every source in ``ui/`` is reused as it is (like scripts/setup.sh): no npm needed then.
- Otherwise ``npm ci && npm run build`` runs in ``ui/``; without npm and node a wheel or sdist build fails and says
  how to fix it. An editable install only warns: ``pip install -e .`` comes before npm in scripts/setup.sh, and the
  plugin's page says the bundle is missing until it is built.
- The sdist carries the built bundle (a wheel built from it needs no npm) and ``ui/``'s sources (MANIFEST.in), so
  that a wheel built from it can rebuild the bundle too.

Not part of the installed package: setuptools loads it from the project root while it builds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import ExecError

ROOT = Path(__file__).resolve().parent
UI = ROOT / "ui"
STATIC = ROOT / "airflow_provider_torchelastic" / "plugin" / "static"
#: What ui/build.mjs writes.
OUTPUTS = (STATIC / "torch-elastic.js", STATIC / "icon.svg")
#: What the bundle is built from (scripts/setup.sh compares the same files).
SOURCES = ("src", "package.json", "package-lock.json", "build.mjs")
HOW_TO_FIX = (
    "install Node.js and npm (Debian/Ubuntu: apt-get install nodejs npm; or from https://nodejs.org) and build "
    "again, or build the bundle first in a checkout: cd ui && npm ci && npm run build (make setup does it)"
)


def _newest_source() -> float:
    paths = [path for name in SOURCES for path in ((UI / name).rglob("*") if (UI / name).is_dir() else [UI / name])]
    return max((path.stat().st_mtime for path in paths if path.is_file()), default=0.0)


def bundle_is_current() -> bool:
    """The built bundle is there and no source is newer (sources missing, as in a bare copy: it is what it is)."""
    if not all(p.is_file() for p in OUTPUTS):
        return False
    return min(p.stat().st_mtime for p in OUTPUTS) >= _newest_source()


#: Set to ``skip`` where the UI is not wanted and cannot be built: the runner image (docker/Dockerfile) and the test
#: cluster's copy of it install the package only to run training, from a copy without ui/ and without npm.
SKIP_ENV = "TORCHELASTIC_UI_BUNDLE"


def ensure_bundle() -> None:
    """Build the bundle unless it is current; raise, saying what is missing, when it cannot be built."""
    if os.environ.get(SKIP_ENV) == "skip":
        print(f"{SKIP_ENV}=skip: building without the UI plugin's bundle (its pages will say it is missing)")
        return
    if bundle_is_current():
        return
    bundle = OUTPUTS[0].relative_to(ROOT)
    if not (UI / "package.json").is_file():
        raise ExecError(f"the UI plugin's bundle ({bundle}) is not built and its sources ({UI}/) are missing")
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        state = "out of date" if OUTPUTS[0].is_file() else "not built"
        raise ExecError(
            f"the UI plugin's bundle ({bundle}) is {state}, and {' and '.join(missing)} (needed to build it from "
            f"ui/) cannot be found: {HOW_TO_FIX}"
        )
    print("building the UI plugin's bundle: npm ci && npm run build (in ui/)", flush=True)
    for command in (["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], ["npm", "run", "build"]):
        done = subprocess.run(command, cwd=UI, check=False)
        if done.returncode != 0:
            raise ExecError(f"{' '.join(command)} (in {UI}) exited with {done.returncode}: see its output above")
    if not all(p.is_file() for p in OUTPUTS):
        raise ExecError(f"npm run build did not write {', '.join(str(p) for p in OUTPUTS)}")


class BuildPy(build_py):
    """Wheels and editable installs: the bundle first, then the package's files."""

    def run(self) -> None:
        try:
            ensure_bundle()
        except ExecError as e:
            if not self.editable_mode:
                raise
            # The source tree is what gets imported: the bundle can be built there later (make setup).
            print(f"WARNING: {e}; the plugin's pages say so until it is built", flush=True)
        # The package data list may have been made (egg_info's file list) before the bundle existed: make it again.
        self.__dict__.pop("data_files", None)
        super().run()


class Sdist(sdist):
    """The bundle before the file list is made, so that the sdist ships it (package data) beside ui/'s sources."""

    def run(self) -> None:
        ensure_bundle()
        super().run()
