"""CI cannot pass by skipping a tier: ``.ci/run`` refuses TORCHELASTIC_SKIP_CLUSTER, and any unexpected skip fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def check(tmp_path: Path, *reasons: str) -> subprocess.CompletedProcess[str]:
    report = tmp_path / "skips.jsonl"
    report.write_text("".join(json.dumps({"test": f"t{i}", "reason": r}) + "\n" for i, r in enumerate(reasons)))
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_skips.py"), str(report)], capture_output=True, text=True
    )


def test_expected_skips_pass_and_are_printed(tmp_path: Path) -> None:
    done = check(tmp_path, "needs a CUDA device", "upstream CRD not at /x/crds/y.yaml (../shared/crds/ ...)")
    assert done.returncode == 0, done.stderr
    assert "skipped tests: 2" in done.stdout and "needs a CUDA device" in done.stdout


@pytest.mark.parametrize(
    "reason", ["TORCHELASTIC_SKIP_CLUSTER=1: local cluster tests skipped", "no chromium", "could not import 'x'"]
)
def test_any_other_skip_fails_ci(tmp_path: Path, reason: str) -> None:
    done = check(tmp_path, "needs a CUDA device", reason)
    assert done.returncode == 1 and reason in done.stdout and "CI does not accept" in done.stderr


def test_a_missing_report_fails(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_skips.py"), str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "did pytest run" in done.stderr


def test_ci_refuses_to_skip_the_cluster_before_running_anything() -> None:
    env = {**os.environ, "TORCHELASTIC_SKIP_CLUSTER": "1"}
    done = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1 and "TORCHELASTIC_SKIP_CLUSTER=1" in done.stderr


def test_the_suite_writes_its_skips_where_ci_reads_them(tmp_path: Path) -> None:
    test = tmp_path / "test_x.py"
    test.write_text(
        "import pytest\n\ndef test_a():\n    pytest.skip('needs a CUDA device')\n\ndef test_b():\n    pass\n"
    )
    report = tmp_path / "skips.jsonl"
    env = {**os.environ, "TORCHELASTIC_SKIP_REPORT": str(report)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(test)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    skips = [json.loads(line) for line in report.read_text().splitlines()]
    assert [s["reason"] for s in skips] == ["needs a CUDA device"]
