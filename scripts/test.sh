#!/usr/bin/env bash
# The whole test suite: lint, types, then pytest (unit, contract, runner, local end to end, and the Kubernetes
# layers against a real kube-apiserver whose pods run in the runner image's environment; this script builds both, or
# reuses them from their cache, first; and a real Airflow deployment on Debian's PostgreSQL, installed if missing).
# It ends with a time budget: each step's time, and pytest's per tier (scripts/ci_guard.py times).
set -euo pipefail
cd "$(dirname "$0")/.."

# The pytest run's report (tests/conftest.py), from which the budget reads each tier's time: .ci/run names its own,
# which it then checks; otherwise one in a folder of our own, removed at the end.
if [ -z "${TORCHELASTIC_TEST_REPORT:-}" ]; then
  report_dir=$(mktemp -d "${TMPDIR:-/tmp}/torchelastic-test.XXXXXX")
  export TORCHELASTIC_TEST_REPORT="$report_dir/report.jsonl"
fi
steps=()
# Printed however the script ends, so that a failed or interrupted run still says where its time went.
budget() {
  [ -x .venv/bin/python ] &&
    .venv/bin/python scripts/ci_guard.py times "$TORCHELASTIC_TEST_REPORT" "${steps[@]}" --total "$SECONDS" || true
  if [ -n "${report_dir:-}" ]; then rm -rf "$report_dir"; fi
}
trap budget EXIT
# step NAME COMMAND...: run one step, and note its time (whole seconds) for the budget.
step() {
  local name=$1 started=$SECONDS
  shift
  "$@"
  steps+=("$name=$((SECONDS - started))")
}

step setup bash scripts/setup.sh
echo "==> ruff"
ruff_check() { .venv/bin/ruff check . && .venv/bin/ruff format --check .; }
step ruff ruff_check
echo "==> mypy"
step mypy .venv/bin/mypy
echo "==> import contracts (lint-imports: [tool.importlinter] in pyproject.toml)"
step lint-imports .venv/bin/lint-imports
echo "==> docs (sphinx-build -n -W: every reference resolves, no warning; make docs)"
step docs .venv/bin/sphinx-build -b html -n -W --keep-going -q docs docs/_build/html

if [ "${TORCHELASTIC_SKIP_CLUSTER:-0}" != "1" ]; then
  echo "==> kube-apiserver (built once from Debian's kubernetes source, then cached)"
  step kube-apiserver bash scripts/build-kube-apiserver.sh
  echo "==> kubelet, kube-scheduler, kube-controller-manager (the real node's: built once from the same source, then cached)"
  step node bash scripts/build-kube-node.sh
  echo "==> runner env (the pods' Python: built like docker/Dockerfile, then cached)"
  step runner-env bash scripts/build-runner-env.sh
  echo "==> runner image (docker/Dockerfile itself, with Debian's buildah; cached: a code change rebuilds only the package layers)"
  step runner-image .venv/bin/python -m tests.cluster.image
  echo "==> PostgreSQL (the Airflow deployment tests' metadata database: Debian's, installed once if missing)"
  step postgres .venv/bin/python -m tests.airflow_services install-postgres
  echo "==> Chromium (the browser tests' headless browser: Debian's, installed once if missing)"
  install_chromium() {
    command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
  }
  step chromium install_chromium
fi

# Two pytest workers by default (TORCHELASTIC_TEST_WORKERS=1 for one process): the tests of the one Airflow
# deployment stay together on one (tests/conftest.py groups them); every other test goes to whichever worker is free,
# and each worker starts its own local cluster for the cluster tests it gets. Most cluster tests wait on pods, so
# the two overlap well even on two cores.
workers=${TORCHELASTIC_TEST_WORKERS:-2}
xdist=()
if [ "$workers" -gt 1 ]; then xdist=(-n "$workers" --dist loadgroup); fi
echo "==> pytest (${workers} worker(s))"
started=$SECONDS
set +e
.venv/bin/python -m pytest -p no:cacheprovider -q "${xdist[@]}" "$@"
rc=$?
set -e
steps+=("pytest=$((SECONDS - started))")
# pytest's own status, 5 (no test collected) included: a run that tested nothing did not pass.
exit "$rc"
