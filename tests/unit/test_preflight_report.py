"""The preflight's pure part: the RBAC table against deploy/, rows -> table text, JSON and exit status. No cluster."""

from __future__ import annotations

import json

import pytest
import yaml

from airflow_provider_torchelastic.core.payload import FORMAT_VERSION
from airflow_provider_torchelastic.core.version import __version__
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes import preflight as pf
from airflow_provider_torchelastic.kubernetes.kinds.pytorchjob import TRAINING_OPERATOR_INSTALL
from airflow_provider_torchelastic.kubernetes.preflight import Check, Report, Result
from tests.conftest import REPO_ROOT
from tests.fake_kind import FAKE_JOB


def _role_rules(path: str) -> dict[tuple[str, str], set[str]]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((REPO_ROOT / path).read_text())}
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in docs["Role"]["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                rules.setdefault((group, resource), set()).update(rule["verbs"])
    return rules


def _as_dict(rules: tuple[pf.Rule, ...]) -> dict[tuple[str, str], set[str]]:
    assert len({(r.group, r.resource) for r in rules}) == len(rules), "one rule per resource"
    return {(r.group, r.resource): set(r.verbs) for r in rules}


def test_the_provider_rules_are_deploy_rbac_yaml() -> None:
    assert _as_dict(pf.provider_rules(kinds.BUILT_IN)) == _role_rules("deploy/rbac.yaml")


def test_the_ui_rules_are_deploy_rbac_ui_yaml() -> None:
    assert _as_dict(pf.ui_rules(kinds.BUILT_IN)) == _role_rules("deploy/rbac-ui.yaml")


def test_a_plugged_kind_adds_its_own_rule() -> None:
    rules = _as_dict(pf.provider_rules((FAKE_JOB, *kinds.BUILT_IN)))
    assert rules[("example.dev", "fakejobs")] == set(pf.JOB_VERBS)


def _report(*checks: Check) -> Report:
    return Report(namespace="ml", checks=checks, source="connection k8s")


OK = Check(name="Pod API v1 (pods)", result=Result.OK, detail="served")
OPTIONAL_MISSING = Check(
    name="Kueue LocalQueue ml/q",
    result=Result.MISSING,
    detail="Kueue not installed",
    fix="install Kueue",
    required=False,
)


@pytest.mark.parametrize(
    ("checks", "code"),
    [
        ((OK,), 0),
        ((OK, OPTIONAL_MISSING), 0),
        ((OK, Check(name="x", result=Result.MISSING, fix="do y")), 1),
        # A required row the preflight could not confirm fails a CI gate too.
        ((OK, Check(name="x", result=Result.UNKNOWN)), 1),
        ((OK, Check(name="x", result=Result.UNKNOWN, required=False)), 0),
    ],
    ids=["ok", "optional-missing", "required-missing", "required-unknown", "optional-unknown"],
)
def test_exit_status(checks: tuple[Check, ...], code: int) -> None:
    assert _report(*checks).exit_code == code


def test_table_is_aligned_with_a_fix_for_each_failing_row() -> None:
    missing = Check(name="RBAC pods/log: get", result=Result.MISSING, detail="denied: get", fix="add the rule")
    table = _report(OK, missing, OPTIONAL_MISSING).to_table()
    lines = table.splitlines()
    assert lines[0].split() == ["CHECK", "RESULT", "DETAIL", "FIX"]
    rows = lines[1:4]
    # Every column starts at the same offset on every line.
    for column in ("RESULT", "DETAIL", "FIX"):
        offset = lines[0].index(column)
        assert all(row[offset - 2 : offset] == "  " and row[offset] != " " for row in rows), (column, table)
    assert rows[0].endswith(" -")  # an ok row has no fix
    assert rows[1].endswith("add the rule")
    assert rows[2].startswith("Kueue LocalQueue ml/q *")
    assert lines[-1] == "not ready: 1 check the provider needs failed (connection k8s, namespace ml)"
    assert _report(OK).to_table().splitlines()[-1].startswith("ready: ")


def test_json_has_every_row_and_the_verdict() -> None:
    doc = json.loads(_report(OK, OPTIONAL_MISSING).to_json())
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["namespace"] == "ml"
    assert doc["checks"][1] == {
        "check": "Kueue LocalQueue ml/q",
        "result": "missing",
        "required": False,
        "detail": "Kueue not installed",
        "fix": "install Kueue",
    }


def test_api_rows_name_the_install() -> None:
    served = pf.api_check(kinds.PYTORCHJOB, ["pytorchjobs", "pytorchjobs/status"])
    assert served.result is Result.OK
    operator = pf.api_check(kinds.PYTORCHJOB, None)
    assert (
        operator.result is Result.MISSING
        and operator.fix == kinds.PYTORCHJOB.install_hint
        and TRAINING_OPERATOR_INSTALL in operator.fix
    )
    fake = pf.api_check(FAKE_JOB, None)
    assert fake.detail == "example.dev/v1 not served"
    assert "fakejobs.example.dev" in fake.fix
    assert pf.api_check(FAKE_JOB, ["other"]).detail == "example.dev/v1 served without fakejobs"
    assert pf.api_check(FAKE_JOB, None, "timed out").result is Result.UNKNOWN


def test_crd_rows() -> None:
    crd = {"spec": {"versions": [{"name": "v1", "served": True}, {"name": "v2", "served": False}]}}
    assert pf.crd_check(kinds.PYTORCHJOB, crd).detail == "served versions: v1"
    forbidden = pf.crd_check(kinds.PYTORCHJOB, None, 403, "Forbidden")
    assert (forbidden.result, forbidden.detail, forbidden.required) == (
        Result.UNKNOWN,
        "unknown (no permission)",
        False,
    )
    assert pf.crd_check(FAKE_JOB, None).result is Result.MISSING


def test_access_rows() -> None:
    rule = pf.Rule("", "pods/log", ("get",))
    assert (rule.plain_resource, rule.subresource) == ("pods", "log")
    assert pf.access_check(rule, {"get": True}, namespace="ml").result is Result.OK
    denied = pf.access_check(rule, {"get": False}, namespace="ml")
    assert denied.result is Result.MISSING
    assert (
        denied.fix == 'add to the identity\'s Role in ml: - {apiGroups: [""], resources: ["pods/log"], verbs: ["get"]}'
    )
    # The fix parses as the Role rule it names.
    assert yaml.safe_load(denied.fix.partition(": ")[2]) == [
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}
    ]
    unknown = pf.access_check(rule, {"get": None}, namespace="ml", errors={"get": "403"})
    assert unknown.result is Result.UNKNOWN and "403" in unknown.detail


def test_version_rows() -> None:
    assert pf.version_check({"gitVersion": "v1.30.2"}).detail == "v1.30.2: nothing special"
    assert pf.version_check({"gitVersion": "v1.20.2"}).detail == (
        "v1.20.2: nothing special (the objects are validated against 1.25-1.37)"
    )
    assert pf.version_check(None, "refused").result is Result.UNKNOWN


def test_smoke_and_queue_rows() -> None:
    failed = pf.smoke_check("repo/img:1", succeeded=False, detail="payload format 2 is not\nsupported")
    assert failed.detail == "payload format 2 is not supported"
    assert "repo/img:1" in failed.fix and __version__ in failed.fix and f"payload format {FORMAT_VERSION}" in failed.fix
    assert pf.smoke_check(None, succeeded=False, detail="").fix.startswith("pass --image")
    assert pf.smoke_check("repo/img:1", succeeded=True, detail="").result is Result.OK
    kueue = pf.queue_check("q", "ml", served=False, found=None)
    assert kueue.detail.startswith("Kueue not installed") and not kueue.required
    assert pf.queue_check("q", "ml", served=True, found=False).result is Result.MISSING


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_provider_torchelastic.preflight import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--no-such-option"])
    assert exit_info.value.code == 2
    assert "usage: python -m airflow_provider_torchelastic.preflight" in capsys.readouterr().err


def test_every_command_line_option_reaches_run_preflight(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import inspect

    from airflow_provider_torchelastic import preflight

    parameters = inspect.signature(preflight.run_preflight).parameters
    asked: list[dict[str, object]] = []

    def run_preflight(**options: object) -> Report:
        assert set(options) <= set(parameters), "main() passes each option as the parameter of its name"
        asked.append(options)
        return Report(namespace="ml")

    monkeypatch.setattr(preflight, "run_preflight", run_preflight)
    argv = ["--conn-id", "k8s", "--namespace", "ml", "--smoke", "--image", "repo/img:1", "--smoke-timeout", "60"]
    assert preflight.main([*argv, "--queue", "q", "--json"]) == 0
    assert asked == [
        {"conn_id": "k8s", "namespace": "ml", "smoke": True, "image": "repo/img:1", "smoke_timeout": 60.0, "queue": "q"}
    ]
    assert json.loads(capsys.readouterr().out)["namespace"] == "ml"


def test_a_refused_submission_names_what_serves_its_kind_not_another_kinds_controller(tmp_path) -> None:
    from airflow_provider_torchelastic.errors import KubeError
    from airflow_provider_torchelastic.kubernetes.submit import refusal
    from airflow_provider_torchelastic.kubernetes.wait_types import JobRef
    from tests import fake_kind

    gone = KubeError(404, "Not Found", "the server could not find the requested resource")
    pytorchjob = refusal(JobRef(kind="PyTorchJob", name="j", namespace="ml"), gone).message
    assert "is the Kubeflow training operator (its PyTorchJob CRD, kubeflow.org/v1) installed" in pytorchjob
    with fake_kind.plugged(tmp_path):
        fake = refusal(JobRef(kind="FakeJob", name="j", namespace="ml"), gone).message
    assert "is the controller of FakeJob (its FakeJob CRD, example.dev/v1) installed" in fake
    assert "training operator" not in fake


def test_a_kind_with_pods_of_its_own_must_say_how_its_pods_name_it() -> None:
    import dataclasses

    with pytest.raises(ValueError, match=r"JobKind FakeJob: pod_owner_label: expected the pod label"):
        dataclasses.replace(FAKE_JOB, pod_owner_label=None)
    assert dataclasses.replace(kinds.POD, pod_owner_label=None).pod_controllers == ()  # its own pod: nothing to name


def test_one_multi_node_kind_is_enough_but_a_plugged_in_kind_stays_required() -> None:
    def apis(served: set[str]) -> dict[kinds.JobKind, Check]:
        return {
            kind: pf.api_check(kind, [kind.plural] if kind.kind in served else None)
            for kind in (kinds.POD, kinds.PYTORCHJOB, kinds.TRAINJOB, FAKE_JOB)
        }

    alternatives = {"PyTorchJob", "TrainJob"}
    rows = pf.with_alternatives(apis({"Pod", "PyTorchJob"}), alternatives)
    assert rows["TrainJob"].result is Result.MISSING and not rows["TrainJob"].required
    assert "PyTorchJob served instead: needed only where job_kind asks for it" in rows["TrainJob"].detail
    assert rows["FakeJob"].required, "a plugged-in kind claims configs first: its missing API fails the preflight"
    neither = pf.with_alternatives(apis({"Pod"}), alternatives)
    assert neither["PyTorchJob"].required and neither["TrainJob"].required, "no multi-node kind at all"
