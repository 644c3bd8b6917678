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
  echo "==> installing airflow-provider-torchelastic[test,frameworks,docs] (Airflow, torch 2.13.0 CPU, test tools, the training frameworks, Sphinx)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 is pinned in the test extra: a looser pin would pull a multi-GB CUDA build. The frameworks extra
  # (transformers, lightning, accelerate) resolves with it, so it keeps that torch.
  .venv/bin/python -m pip install -q -e ".[test,frameworks,docs]"
  echo "$want" > "$stamp"
fi

# The UI plugin's bundle (airflow_provider_torchelastic/plugin/static, git-ignored, shipped in the wheel): built from
# ui/ with npm, only when a source is newer than the built bundle.
bundle=airflow_provider_torchelastic/plugin/static/torch-elastic.js
if [ ! -f "$bundle" ] || [ -n "$(find ui/src ui/package.json ui/package-lock.json ui/build.mjs -newer "$bundle" 2>/dev/null | head -1)" ]; then
  if ! command -v npm >/dev/null; then
    echo "==> installing Node.js and npm (Debian's) to build the UI bundle"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null
  fi
  echo "==> building the UI plugin bundle (ui/: npm ci && npm run build)"
  (cd ui && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent)
fi
