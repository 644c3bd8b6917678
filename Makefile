# The two commands of the README: `make demo` (set up, run the quickstart DAG locally) and `make test` (everything).
.PHONY: demo ui test setup lint docs cluster-up cluster-down golden crd bench bench-triggerer bench-artifacts bench-real-node test-torch

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python scripts/quickstart.py

# Airflow's UI on the home `make demo` kept: its run in the "Training jobs" page and the "Training job" tab.
ui: setup
	bash scripts/ui.sh

test: setup
	bash scripts/test.sh

# The docs site (docs/: Sphinx, MyST, furo) into docs/_build/html; warnings are errors, every reference must resolve,
# and nothing is fetched (no intersphinx, no link check). .ci/run builds it too (scripts/test.sh's docs step).
docs: setup
	.venv/bin/sphinx-build -b html -n -W --keep-going -q docs docs/_build/html
	@echo "==> docs/_build/html/index.html"

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy && .venv/bin/lint-imports

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
	.venv/bin/python benchmarks/import_cost.py

# A 1 GiB state dict saved from rank 0 and loaded downstream as an artifact, against a raw fsspec copy of the same
# bytes, over file:// and an S3-compatible server (moto); about a quarter of an hour on 2 CPUs. Not part of `make test`.
bench-artifacts: setup
	.venv/bin/python benchmarks/artifacts.py

# Hundreds of deferred jobs in one triggerer on the local cluster (about 25 min); not part of `make test`.
bench-triggerer: setup
	bash scripts/build-kube-apiserver.sh
	bash scripts/build-runner-env.sh
	.venv/bin/python benchmarks/bench_triggerer.py

# The task's overhead beyond its pods' run on the local cluster's real node, Pod and PyTorchJob, deferred and not,
# beside KubernetesPodOperator + torchrun in the same image (about 10 min warm); not part of `make test`.
bench-real-node: setup
	bash scripts/build-kube-apiserver.sh
	bash scripts/build-kube-node.sh
	bash scripts/build-runner-env.sh
	.venv/bin/python -m tests.cluster.image
	.venv/bin/python benchmarks/bench_real_node.py

# The runner's tests (tests/runner) against torch 2.14.1 and 2.15.0, each in a throwaway venv: CUDA builds of several
# GB here, so not part of `make test`. Prints the rows of docs/installation.md's torch table.
test-torch: setup
	bash scripts/test_torch.sh
