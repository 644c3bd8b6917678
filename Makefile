# The two commands of the README: `make demo` (set up, run the quickstart DAG locally) and `make test` (everything).
.PHONY: demo test setup lint cluster-up cluster-down golden crd bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python scripts/quickstart.py

test: setup
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

cluster-up: setup
	.venv/bin/python -m tests.cluster up

cluster-down:
	.venv/bin/python -m tests.cluster down

golden: setup
	UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/contract/test_golden.py -q

# Needs ../shared/crds/kubeflow.org_pytorchjobs.yaml (or TORCHELASTIC_UPSTREAM_CRD_PATH); commit the result.
crd: setup
	.venv/bin/python scripts/derive_crd.py

bench: setup
	.venv/bin/python benchmarks/bench_runner.py
