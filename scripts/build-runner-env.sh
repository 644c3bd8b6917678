#!/usr/bin/env bash
# Build the runner environment of the local test cluster: what docker/Dockerfile puts in the runner image (Python,
# torch, cloudpickle, numpy, and with STORAGE=1 s3fs for checkpoints and results in object storage), as a venv cached
# once per machine. The simulated kubelet runs the pods' `python` and
# `torchrun` with it, so a pod sees what it would see in the real image: no Airflow, no kubernetes client, no checkout.
#
#   build-runner-env.sh              build (or reuse) the cached base env; prints its python
#   build-runner-env.sh --layer DIR  also make DIR a venv layered on the base env, with this checkout installed
#                                    (--no-deps); prints DIR/bin/python. The local cluster makes one per start.
#
# The package itself is not in the cached env: it changes with every commit, and a layer takes about a second.
# Idempotent and non-interactive. The LAST line of stdout is the python path (callers do `... | tail -1`); progress
# goes to stderr. The base env is built in a temporary directory next to the cache and renamed into place once it
# passed its check, so an interrupted build never leaves a cache entry that looks complete.
#
# Env:
#   TORCHELASTIC_KUBE_CACHE         cache dir (default: $HOME/.cache/airflow-provider-torchelastic)
#   TORCHELASTIC_REFERENCE_PYTHON   the Airflow side's python (default: .venv/bin/python): the env gets its Python
#                                   version (payloads are pickled bytecode) and its cloudpickle, numpy and s3fs versions
set -euo pipefail

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
exec </dev/null

REPO="$(cd "$(dirname "$0")/.." && pwd)"
TORCH_VERSION=2.13.0  # exactly this: a looser pin downloads a multi-GB CUDA build instead of the CPU wheel
RECIPE=2              # bump when what this script puts into the base env changes (2: s3fs, as STORAGE=1 adds)
CACHE_DIR="${TORCHELASTIC_KUBE_CACHE:-$HOME/.cache/airflow-provider-torchelastic}"
REF_PY="${TORCHELASTIC_REFERENCE_PYTHON:-$REPO/.venv/bin/python}"

log() { printf '[build-runner-env] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

LAYER=""
case "${1:-}" in
    "") ;;
    --layer) [[ -n "${2:-}" ]] || die "--layer needs a directory"; LAYER="$2" ;;
    *) die "usage: $0 [--layer DIR]" ;;
esac

[[ -x "$REF_PY" ]] || die "reference python $REF_PY not found (run scripts/setup.sh, or set TORCHELASTIC_REFERENCE_PYTHON)"
read -r BASE_PY PY_VERSION CLOUDPICKLE_VERSION NUMPY_VERSION S3FS_VERSION < <("$REF_PY" -c '
import os, platform, sys
from importlib.metadata import version
# The interpreter behind the venv: an env made from it has the same Python, as the image must.
print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), platform.python_version(),
      version("cloudpickle"), version("numpy"), version("s3fs"))
')
[[ -n "${S3FS_VERSION:-}" ]] || die "could not read the Python, cloudpickle, numpy and s3fs versions of $REF_PY"

NAME="runner-env-py$PY_VERSION-torch$TORCH_VERSION-cloudpickle$CLOUDPICKLE_VERSION-numpy$NUMPY_VERSION-s3fs$S3FS_VERSION-r$RECIPE"
BASE="$CACHE_DIR/$NAME"

site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }

# make_layer BASE_ENV DIR: DIR becomes a venv whose site-packages reaches BASE_ENV's through a .pth, with the
# checkout installed into DIR itself. A venv (not PYTHONPATH) because a pod's env must hold only what a kubelet sets.
make_layer() {
    local base="$1" dir="$2" src
    rm -rf "$dir"
    "$base/bin/python" -m venv --without-pip "$dir"
    # addsitedir, not a bare path line: it also runs the base env's own .pth files, as its python would.
    printf "import site; site.addsitedir('%s')\n" "$(site_packages "$base/bin/python")" \
        >"$(site_packages "$dir/bin/python")/_torchelastic_runner_base.pth"
    # What torch's wheel puts on the image's PATH, for containers that run `sh -c "torchrun ..."`.
    printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$dir/bin/python" \
        >"$dir/bin/torchrun"
    chmod +x "$dir/bin/torchrun"
    # Only what the Dockerfile copies, so that nothing else of the checkout (tests, build outputs) gets in.
    src="$(mktemp -d "${TMPDIR:-/tmp}/torchelastic-runner-src.XXXXXX")"
    cp "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/build_ui.py" "$src/"
    cp -r "$REPO/airflow_provider_torchelastic" "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    # The pods run training, not the UI: as in the Dockerfile, the package installs without the plugin's bundle.
    if ! TORCHELASTIC_UI_BUNDLE=skip "$dir/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index \
        "$src" >&2; then
        rm -rf "$src"
        die "installing $REPO into the layer $dir failed"
    fi
    rm -rf "$src"
}

# check_env PYTHON TORCH PACKAGE: the env behaves like the image. TORCH=1 imports torch, cloudpickle and numpy and
# compares their versions (2 s); PACKAGE=1 imports the runner, which must come from the env itself. Runs with nothing
# from this process: no PYTHONPATH, and a cwd that is not the checkout (`python -` puts the cwd on sys.path).
check_env() {
    local python="$1" torch="$2" package="$3" cwd rc=0
    cwd="$(mktemp -d "${TMPDIR:-/tmp}/torchelastic-runner-check.XXXXXX")"
    (cd "$cwd" && env -i PATH=/usr/bin:/bin HOME="$cwd" CHECK_TORCH="$torch" CHECK_PACKAGE="$package" \
        TORCH="$TORCH_VERSION" CLOUDPICKLE="$CLOUDPICKLE_VERSION" NUMPY="$NUMPY_VERSION" "$python" -c '
import importlib, os, sys

for name in ("airflow", "kubernetes"):
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    sys.exit(f"{name} is importable in the runner env ({sys.executable}); the image has no {name}")
if os.environ["CHECK_TORCH"] == "1":
    import cloudpickle, numpy, s3fs, torch

    got = (torch.__version__.split("+")[0], cloudpickle.__version__, numpy.__version__)
    want = (os.environ["TORCH"], os.environ["CLOUDPICKLE"], os.environ["NUMPY"])
    if got != want:
        sys.exit(f"torch/cloudpickle/numpy are {got}, expected {want}")
if os.environ["CHECK_PACKAGE"] == "1":
    import airflow_provider_torchelastic.runner

    where = os.path.dirname(airflow_provider_torchelastic.runner.__file__)
    if not where.startswith(sys.prefix + os.sep):
        sys.exit(f"airflow_provider_torchelastic was imported from {where}, not from the env {sys.prefix}")
') || rc=$?
    rm -rf "$cwd"
    return "$rc"
}

build_base() {
    local started tmp
    started=$(date +%s)
    mkdir -p "$CACHE_DIR"
    # What a killed build (SIGKILL: no trap ran) left; an hour old, so that a concurrent build keeps its own.
    find "$CACHE_DIR" -maxdepth 1 -name ".$NAME.build.*" -mmin +60 -exec rm -rf {} + 2>/dev/null || true
    # Next to the cache, so that the final rename stays on one file system.
    tmp="$(mktemp -d "$CACHE_DIR/.$NAME.build.XXXXXX")"
    chmod 0755 "$tmp"  # mktemp's 0700 would stay on the cached env
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    trap 'exit 130' INT TERM
    log "building $BASE from $BASE_PY (torch $TORCH_VERSION CPU, cloudpickle $CLOUDPICKLE_VERSION, numpy $NUMPY_VERSION, s3fs $S3FS_VERSION)"
    "$BASE_PY" -m venv "$tmp"
    # s3fs (the S3 tests' pods write checkpoints and results through it) pins the fsspec that torch needs too.
    "$tmp/bin/python" -m pip install -q --progress-bar off "torch==$TORCH_VERSION" \
        "cloudpickle==$CLOUDPICKLE_VERSION" "numpy==$NUMPY_VERSION" "s3fs==$S3FS_VERSION" >&2
    check_env "$tmp/bin/python" 1 0 || die "the new env failed its check; nothing was cached"
    # Console scripts (pip, torchrun) name the interpreter by its absolute path: point them at the final place.
    grep -rlIZ -- "$tmp" "$tmp/bin" "$tmp/pyvenv.cfg" | xargs -0 -r sed -i "s#$tmp#$BASE#g"
    # -T: fail instead of moving into a directory that a concurrent build renamed into place first.
    if ! mv -T "$tmp" "$BASE" 2>/dev/null; then
        [[ -x "$BASE/bin/python" ]] || die "could not move $tmp to $BASE"
        log "another build finished first; using it"
    fi
    log "cached $BASE in $(($(date +%s) - started)) s"
}

if ! { [[ -x "$BASE/bin/python" ]] && "$BASE/bin/python" -c '' 2>/dev/null; }; then
    if [[ -e "$BASE" ]]; then
        log "removing unusable $BASE"
        rm -rf "$BASE"
    fi
    build_base
    # The whole image, as the cluster will use it: the new base env with this checkout layered on it.
    log "checking the env with this checkout layered on it"
    probe="$(mktemp -d "${TMPDIR:-/tmp}/torchelastic-runner-layer.XXXXXX")"
    make_layer "$BASE" "$probe/env"
    if ! check_env "$probe/env/bin/python" 1 1; then
        rm -rf "$probe"
        die "$BASE is cached, but this checkout does not work in it (see above)"
    fi
    rm -rf "$probe"
fi

if [[ -n "$LAYER" ]]; then
    LAYER="$(mkdir -p "$(dirname "$LAYER")" && cd "$(dirname "$LAYER")" && pwd)/$(basename "$LAYER")"
    make_layer "$BASE" "$LAYER"
    # Not torch again (the base env passed that when it was built): the layer's own part, in a fraction of a second.
    check_env "$LAYER/bin/python" 0 1 || die "the layer $LAYER failed its check"
    echo "$LAYER/bin/python"
else
    echo "$BASE/bin/python"
fi
