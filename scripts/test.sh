#!/usr/bin/env bash
# The whole test suite: lint, types, then pytest (unit, contract, runner, local end to end, and the Kubernetes
# layers against a real kube-apiserver whose pods run in the runner image's environment; this script builds both, or
# reuses them from their cache, first; and a real Airflow deployment on Debian's PostgreSQL, installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "==> mypy"
.venv/bin/mypy
echo "==> import contracts (lint-imports: [tool.importlinter] in pyproject.toml)"
.venv/bin/lint-imports

if [ "${TORCHELASTIC_SKIP_CLUSTER:-0}" != "1" ]; then
  echo "==> kube-apiserver (built once from Debian's kubernetes source, then cached)"
  bash scripts/build-kube-apiserver.sh
  echo "==> kubelet, kube-scheduler, kube-controller-manager (the real node's: built once from the same source, then cached)"
  bash scripts/build-kube-node.sh
  echo "==> runner env (the pods' Python: built like docker/Dockerfile, then cached)"
  bash scripts/build-runner-env.sh
  echo "==> runner image (docker/Dockerfile itself, with Debian's buildah; cached: a code change rebuilds only the package layers)"
  .venv/bin/python -m tests.cluster.image
  echo "==> PostgreSQL (the Airflow deployment tests' metadata database: Debian's, installed once if missing)"
  .venv/bin/python -m tests.airflow_services install-postgres
  echo "==> Chromium (the browser tests' headless browser: Debian's, installed once if missing)"
  command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
fi

# Two pytest workers by default (TORCHELASTIC_TEST_WORKERS=1 for one process): the tests of the one Airflow
# deployment stay together on one (tests/conftest.py groups them); every other test goes to whichever worker is free,
# and each worker starts its own local cluster for the cluster tests it gets. Most cluster tests wait on pods, so
# the two overlap well even on two cores.
workers=${TORCHELASTIC_TEST_WORKERS:-2}
xdist=()
if [ "$workers" -gt 1 ]; then xdist=(-n "$workers" --dist loadgroup); fi
echo "==> pytest (${workers} worker(s))"
set +e
.venv/bin/python -m pytest -p no:cacheprovider -q "${xdist[@]}" "$@"
rc=$?
set -e
# 5 = no tests collected: only possible when a caller narrows the selection; not a failure of the suite.
if [ "$rc" -eq 5 ]; then rc=0; fi
exit "$rc"
