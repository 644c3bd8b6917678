#!/usr/bin/env bash
# `make ui`: Airflow's api-server on the Airflow home that `make demo` kept, so that its run shows in the
# "Training jobs" page and the task's "Training job" tab. A local demo: everyone is admin, without a login.
set -euo pipefail
cd "$(dirname "$0")/.."
home=${TORCHELASTIC_DEMO_HOME:-$PWD/.demo/airflow-home}
port=${TORCHELASTIC_UI_PORT:-8080}
if [ ! -f "$home/airflow.db" ]; then
  echo "no demo run in $home: run \`make demo\` first" >&2
  exit 1
fi
export AIRFLOW_HOME="$home" \
  AIRFLOW__CORE__LOAD_EXAMPLES=False \
  AIRFLOW__CORE__DAGS_FOLDER="$PWD/example_dags" \
  AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="sqlite:///$home/airflow.db" \
  AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True \
  AIRFLOW__API__BASE_URL="http://127.0.0.1:$port"
echo "==> Airflow UI on the demo's home ($home); Ctrl-C stops it"
echo "    Training jobs: http://127.0.0.1:$port/plugin/training-jobs"
exec .venv/bin/airflow api-server --host 127.0.0.1 --port "$port"
