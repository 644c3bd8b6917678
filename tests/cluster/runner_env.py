"""The runner environment that the simulated kubelet runs containers' Pythons with: the runner image, as a venv.

``scripts/build-runner-env.sh`` builds it like ``docker/Dockerfile`` builds the image (torch, cloudpickle, numpy, and
s3fs as ``STORAGE=1`` adds it, for the storage tests; no Airflow, no kubernetes client) and caches it once per machine,
keyed by what goes into it. This checkout is not part of the cached env: every cluster start layers the current code
on top of it (``<state dir>/runner-env``, a venv that reaches the cached env's site-packages through a ``.pth`` and
has the package installed ``--no-deps``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-runner-env.sh"
#: The per-cluster layer, inside the cluster's state dir.
LAYER_DIRNAME = "runner-env"


class RunnerEnvError(RuntimeError):
    """The runner env could not be built or layered; the message quotes the script's output."""


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHELASTIC_KUBE_CACHE") or Path.home() / ".cache" / "airflow-provider-torchelastic")


def ensure_base(*, log: Callable[[str], None] | None = None, show_output: bool = False) -> Path:
    """The cached env's python, built first if missing (about a minute, from the local wheel of torch)."""
    return _run([], cache_dir() / "runner-env-build.log", log=log, show_output=show_output)


def make_layer(state_dir: Path, *, log: Callable[[str], None] | None = None, show_output: bool = False) -> Path:
    """Layer this checkout on the cached env (building that first if missing); returns the layer's python."""
    state_dir = Path(state_dir)
    return _run(
        ["--layer", str(state_dir / LAYER_DIRNAME)],
        state_dir / "logs" / "runner-env.log",
        log=log,
        show_output=show_output,
    )


def run_script(
    command: list[str],
    build_log: Path,
    *,
    env: dict[str, str],
    show_output: bool = False,
    on_line: Callable[[str], None] | None = None,
) -> tuple[int, list[str]]:
    """Run a build script without stdin, its output teed to ``build_log`` (and stderr with ``show_output``).

    Returns the exit code and the output lines; the build scripts print their product's path last.
    """
    output: list[str] = []
    with open(build_log, "w") as log_file:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if on_line is not None:
                on_line(line)
            log_file.write(line)
            log_file.flush()
            if show_output:
                sys.stderr.write(line)
        returncode = proc.wait()
    return returncode, output


def _run(args: list[str], build_log: Path, *, log: Callable[[str], None] | None, show_output: bool) -> Path:
    build_log.parent.mkdir(parents=True, exist_ok=True)
    # The env must match the Python and cloudpickle of the process that pickles payloads: this one.
    env = {**os.environ, "TORCHELASTIC_REFERENCE_PYTHON": sys.executable}

    def announce_build(line: str) -> None:
        if log and line.startswith("[build-runner-env] building "):
            log(f"runner env not cached; building it with {BUILD_SCRIPT} (about a minute; log: {build_log})")

    returncode, output = run_script(
        ["bash", str(BUILD_SCRIPT), *args], build_log, env=env, show_output=show_output, on_line=announce_build
    )
    lines = "".join(output).strip().splitlines()
    if returncode != 0 or not lines:
        raise RunnerEnvError(
            f"{BUILD_SCRIPT} {' '.join(args)} failed (exit {returncode}). Last output (all of it in {build_log}):\n"
            + "".join(output[-30:])
        )
    python = Path(lines[-1])  # the script prints the python path last
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise RunnerEnvError(f"{BUILD_SCRIPT} reported {python}, which is not an executable")
    return python
