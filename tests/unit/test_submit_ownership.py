"""Own objects only (issue 19, item 1): a try re-attaches only to objects that carry its token or whose uid it
recorded, and a payload Secret it did not write is replaced, never used; anything else fails naming the object."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes import submit
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef

REF = JobRef(kind="PyTorchJob", name="te-job", namespace="ml")
TOKEN = "a" * 32


def obj(kind: str, name: str, *, token: str | None = None, uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if token is not None:
        meta["annotations"] = {submit.TOKEN_ANNOTATION: token}
    if uid is not None:
        meta["uid"] = uid
    return {"kind": kind, "metadata": meta}


PAYLOAD = {"kind": "Secret", "metadata": {"name": "te-job-payload", "namespace": "ml"}, "data": {}}
WORKLOAD = {"kind": "PyTorchJob", "metadata": {"name": "te-job", "namespace": "ml"}, "spec": {}}


class FakeKube:
    """The cluster as a dict: ``(kind, name) -> object``; records every call."""

    def __init__(self, *existing: dict[str, Any]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in existing}
        self.calls: list[tuple[str, str, str]] = []
        #: Objects that reappear right after they are deleted (someone keeps creating them).
        self.recreated: dict[tuple[str, str], dict[str, Any]] = {}

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, name))
        return self.objects.get((kind, name))

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        key = (manifest["kind"], manifest["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.objects:
            raise KubeError(409, "AlreadyExists", f"{key} already exists")
        created = copy.deepcopy(manifest)
        created["metadata"]["uid"] = f"uid-{key[1]}"
        self.objects[key] = created
        return created

    def delete(self, kind: str, name: str, namespace: str) -> bool:
        self.calls.append(("delete", kind, name))
        existed = self.objects.pop((kind, name), None) is not None
        if (kind, name) in self.recreated:
            self.objects[(kind, name)] = self.recreated.pop((kind, name))
        return existed

    def patch_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append(("patch", "Secret", name))


def submit_to(kube: FakeKube, *, token: str = TOKEN, uid: str | None = None) -> tuple[Any, list[Any]]:
    remembered: list[Any] = []
    answer = submit.create_or_reattach(
        kube,  # type: ignore[arg-type]
        REF,
        PAYLOAD,
        WORKLOAD,
        token=token,
        remembered=None,
        remembered_uid=uid,
        remember=lambda ref, uid: remembered.append((ref, uid)),
        info=lambda *a: None,
        warning=lambda *a: None,
    )
    return answer, remembered


# --- the pure decision -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("existing", "uid", "expected"),
    [
        (None, None, "absent"),
        (obj("PyTorchJob", "te-job", token=TOKEN), None, "ours"),
        (obj("PyTorchJob", "te-job", uid="u-1"), "u-1", "ours"),
        (obj("PyTorchJob", "te-job"), None, "foreign"),
        (obj("PyTorchJob", "te-job", token="b" * 32), None, "foreign"),
        (obj("PyTorchJob", "te-job", token="b" * 32, uid="u-2"), "u-1", "foreign"),
        (obj("PyTorchJob", "te-job", token=""), None, "foreign"),
    ],
)
def test_an_existing_object_is_ours_only_with_this_tries_token_or_recorded_uid(
    existing: dict[str, Any] | None, uid: str | None, expected: str
) -> None:
    assert submit.ownership(existing, token=TOKEN, uid=uid) == expected


def test_no_token_is_never_a_match() -> None:
    assert submit.ownership(obj("Pod", "p", token=""), token="", uid=None) == "foreign"


def test_tokens_are_random_and_the_state_record_keeps_them() -> None:
    assert submit.new_token() != submit.new_token() and len(submit.new_token()) == 32
    record = submit.state_record(REF, 2, token=TOKEN, uid="u-1")
    assert submit.remembered_try(record, 2) == submit.RememberedTry(ref=REF, token=TOKEN, uid="u-1")
    assert submit.remembered_try(record, 3) is None  # a new try gets a new token
    assert submit.remembered_try({"kind": "Pod", "name": "x", "namespace": "ml", "try_number": 2}, 2) is None


# --- create or re-attach ---------------------------------------------------------------------------------------------


def test_a_fresh_try_creates_both_objects_with_its_token_and_records_the_uid() -> None:
    kube = FakeKube()
    answer, remembered = submit_to(kube)
    assert answer == REF
    for key in (("Secret", "te-job-payload"), ("PyTorchJob", "te-job")):
        assert kube.objects[key]["metadata"]["annotations"][submit.TOKEN_ANNOTATION] == TOKEN
    assert remembered == [(REF, None), (REF, "uid-te-job")]  # before creating, and the uid once created
    assert "annotations" not in WORKLOAD["metadata"]  # the rendered manifests are not changed


def test_a_job_with_this_tries_token_is_re_attached_to() -> None:
    kube = FakeKube(obj("PyTorchJob", "te-job", token=TOKEN))
    answer, _ = submit_to(kube)
    assert answer == REF
    assert [c for c in kube.calls if c[0] != "get"] == []


def test_a_job_with_the_recorded_uid_is_re_attached_to() -> None:
    kube = FakeKube(obj("PyTorchJob", "te-job", uid="u-1"))
    assert submit_to(kube, uid="u-1")[0] == REF


def test_a_job_of_the_same_name_without_the_token_is_refused_and_left_alone() -> None:
    kube = FakeKube(obj("PyTorchJob", "te-job"), obj("Secret", "te-job-payload"))
    answer, remembered = submit_to(kube)
    assert isinstance(answer, submit.Refusal) and not answer.recoverable
    assert "PyTorchJob ml/te-job" in answer.message and "not created by this try" in answer.message
    assert [c for c in kube.calls if c[0] != "get"] == [] and remembered == []


def test_a_payload_secret_this_try_did_not_write_is_replaced() -> None:
    squatter = {**obj("Secret", "te-job-payload"), "data": {"payload": "attacker"}}
    kube = FakeKube(squatter)
    answer, _ = submit_to(kube)
    assert answer == REF
    replaced = kube.objects[("Secret", "te-job-payload")]
    assert replaced["data"] == {} and replaced["metadata"]["annotations"][submit.TOKEN_ANNOTATION] == TOKEN
    assert ("delete", "Secret", "te-job-payload") in kube.calls


def test_a_payload_secret_recreated_while_being_replaced_fails_naming_it() -> None:
    kube = FakeKube(obj("Secret", "te-job-payload"))
    kube.recreated[("Secret", "te-job-payload")] = obj("Secret", "te-job-payload")
    answer, _ = submit_to(kube)
    assert isinstance(answer, submit.Refusal) and not answer.recoverable
    assert "Secret ml/te-job-payload" in answer.message
    assert ("PyTorchJob", "te-job") not in kube.objects


def test_a_job_created_by_someone_else_meanwhile_is_refused() -> None:
    kube = FakeKube()
    original = kube.create

    def create(manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["kind"] == "PyTorchJob" and ("PyTorchJob", "te-job") not in kube.objects:
            kube.objects[("PyTorchJob", "te-job")] = obj("PyTorchJob", "te-job", token="b" * 32)
        return original(manifest)

    kube.create = create  # type: ignore[method-assign]
    answer, _ = submit_to(kube)
    assert isinstance(answer, submit.Refusal) and "PyTorchJob ml/te-job" in answer.message
    assert ("Secret", "te-job-payload") not in kube.objects  # this try's own payload is not left behind
    assert kube.objects[("PyTorchJob", "te-job")]["metadata"]["annotations"][submit.TOKEN_ANNOTATION] == "b" * 32


# --- a new try stops the job an earlier try left running (issue 19, item 7) ------------------------------------------


class KubeWithJobs(FakeKube):
    def delete_job(self, ref: JobRef) -> bool:
        existed = self.delete(ref.kind, ref.name, ref.namespace)
        self.delete("Secret", f"{ref.name}-payload", ref.namespace)
        return existed


def finished(job: dict[str, Any]) -> dict[str, Any]:
    return {**job, "status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}


def test_only_an_earlier_tries_record_with_a_token_names_an_earlier_try() -> None:
    record = submit.state_record(REF, 1, token=TOKEN, uid="u-1")
    earlier = submit.earlier_try(record, 2)
    assert earlier == submit.EarlierTry(try_number=1, remembered=submit.RememberedTry(ref=REF, token=TOKEN, uid="u-1"))
    assert submit.earlier_try(record, 1) is None, "the same try re-attaches, it does not stop its own job"
    assert submit.earlier_try(submit.state_record(REF, 3, token=TOKEN), 2) is None
    assert submit.earlier_try({**record, "token": None}, 2) is None
    assert submit.earlier_try({**record, "try_number": True}, 2) is None
    assert submit.earlier_try("garbage", 2) is None


@pytest.mark.parametrize(
    ("job", "deleted"),
    [
        (obj("PyTorchJob", "te-job", token=TOKEN, uid="u-1"), True),
        (obj("PyTorchJob", "te-job", uid="u-1"), True),  # its recorded uid is enough
        (finished(obj("PyTorchJob", "te-job", token=TOKEN, uid="u-1")), False),  # kept by on_finish_action
        (obj("PyTorchJob", "te-job", token="b" * 32, uid="u-2"), False),  # someone else's of that name
        (None, False),
    ],
)
def test_a_new_try_deletes_the_earlier_tries_job_only_while_it_runs_and_only_if_it_is_that_tries(
    job: dict[str, Any] | None, deleted: bool
) -> None:
    kube = KubeWithJobs(*([job] if job is not None else []))
    earlier = submit.earlier_try(submit.state_record(REF, 1, token=TOKEN, uid="u-1"), 2)
    assert earlier is not None
    lines: list[str] = []
    assert submit.stop_earlier_try(kube, earlier, info=lambda *a: lines.append(a[0] % a[1:]), warning=print) is deleted
    assert (("delete", "PyTorchJob", "te-job") in kube.calls) is deleted
    assert any("of try 1 is still running, but its try is over" in line for line in lines) is deleted
