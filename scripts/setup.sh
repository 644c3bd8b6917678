#!/usr/bin/env bash
# Create .venv and install the package with its test tools. Idempotent: skips pip when pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.torchelastic-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing airflow-provider-torchelastic[test] (Airflow, torch 2.13.0 CPU, test tools)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 is pinned in the extra: a looser pin would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
