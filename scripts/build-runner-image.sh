#!/usr/bin/env bash
# Build the runner image from docker/Dockerfile itself (buildah, in its own storage under the cache), its STORAGE=1
# variant and the alpine:3.10 stand-in of init-pytorch, and export each as an OCI archive for a real node's
# containerd: tests/cluster/image.py does the work, this is its command line.
#
#   build-runner-image.sh             build what is missing or stale; the LAST line of stdout is the runner's reference
#   build-runner-image.sh --storage   ... and print the STORAGE=1 variant's reference instead
#   build-runner-image.sh --archives  ... and print "ARCHIVE REF" lines (ctr -n k8s.io images import ARCHIVE)
#   build-runner-image.sh --verbose   show the builds' whole output (it is always in <cache>/images/build.log)
#
# Cold, about ten minutes on two cores (mmdebstrap, torch's layer); a code change rebuilds the package layers only;
# with nothing changed, about a second. Needs root (mmdebstrap, buildah); installs buildah, mmdebstrap and
# busybox-static from Debian when missing.
#
# Env:
#   TORCHELASTIC_KUBE_CACHE         cache dir (default: $HOME/.cache/airflow-provider-torchelastic)
set -euo pipefail
exec </dev/null

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${TORCHELASTIC_REFERENCE_PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || { echo "[build-runner-image] ERROR: $PY not found (run scripts/setup.sh)" >&2; exit 1; }
cd "$REPO"
exec "$PY" -m tests.cluster.image "$@"
