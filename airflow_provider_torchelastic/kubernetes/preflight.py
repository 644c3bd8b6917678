"""What a cluster must offer the provider, and the preflight's verdict on what it found: pure, no I/O.

The preflight (``python -m airflow_provider_torchelastic.preflight``) asks the API; this module holds everything it
decides: the RBAC rules the provider needs (the one table ``deploy/rbac.yaml`` and ``deploy/rbac-ui.yaml`` must
agree with, which a unit test checks), one :class:`Check` per question with its result and the fix when it failed,
and the report's table, JSON and exit status. No Airflow, no Kubernetes client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

from airflow_provider_torchelastic.core.payload import FORMAT_VERSION
from airflow_provider_torchelastic.core.version import __version__
from airflow_provider_torchelastic.kubernetes.kinds import JobKind
from airflow_provider_torchelastic.kubernetes.workloads import WORKLOAD_GROUP, WORKLOAD_PLURAL

__all__ = [
    "EXIT_MISSING",
    "EXIT_OK",
    "JOB_VERBS",
    "KUEUE_GROUP",
    "KUEUE_INSTALL",
    "KUEUE_PLURAL",
    "KUEUE_VERSION",
    "Check",
    "Report",
    "Result",
    "Rule",
    "access_check",
    "api_check",
    "crd_check",
    "provider_rules",
    "queue_check",
    "smoke_check",
    "ui_rules",
    "version_check",
]

EXIT_OK: Final = 0
#: Something the provider needs is missing or could not be confirmed (argparse's usage errors exit 2).
EXIT_MISSING: Final = 1

#: What the provider does with its jobs: create, get (re-attach, poll), delete (finish, kill), list/watch (the
#: triggerer's one shared watch per namespace; without them each trigger polls on its own; and the sweep), and patch
#: (the lease of a job whose task has no execution_timeout, a label its waiter moves forward).
JOB_VERBS: Final = ("create", "get", "list", "watch", "patch", "delete")
#: The pods of a job: get/list to poll, watch for the shared watch.
POD_READ_VERBS: Final = ("get", "list", "watch")
#: The payload Secret: create, patch (the owner reference once the job exists), delete (with the job).
SECRET_VERBS: Final = ("create", "patch", "delete")

KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta1"
KUEUE_PLURAL: Final = "localqueues"
KUEUE_INSTALL: Final = (
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/v0.10.1/manifests.yaml"
)
#: The Kubernetes versions the rendered objects are validated against (README, "Kubernetes execution").
_TESTED: Final = ((1, 25), (1, 37))
_MINOR = re.compile(r"^v?(\d+)\.(\d+)")


class Result(str, Enum):
    OK = "ok"
    MISSING = "missing"
    #: The preflight could not tell (no permission to ask, the API answered an error).
    UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True)
class Check:
    """One row: what was asked, what the cluster said, and how to fix it when it is not ok."""

    name: str
    result: Result
    detail: str = ""
    fix: str = ""
    #: False for what the provider does without (Kueue, the UI's rights, reading CRDs): never fails the exit status.
    required: bool = True

    @property
    def fails(self) -> bool:
        # Unknown fails too when required: a CI gate must not pass on what it could not confirm.
        return self.required and self.result is not Result.OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "result": self.result.value,
            "required": self.required,
            "detail": self.detail,
            "fix": self.fix,
        }


@dataclass(frozen=True, kw_only=True)
class Report:
    namespace: str
    checks: tuple[Check, ...] = ()
    #: Who was asked: the connection id (the CLI) or whatever the caller says.
    source: str = ""

    @property
    def ok(self) -> bool:
        return not any(check.fails for check in self.checks)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_MISSING

    @property
    def failing(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if check.fails)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "namespace": self.namespace,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "checks": [check.to_dict() for check in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_table(self) -> str:
        """Aligned plain text: one row per check (a ``*`` marks the rows that are optional), then a verdict line."""
        header = ("CHECK", "RESULT", "DETAIL", "FIX")
        rows = [
            (f"{check.name}{'' if check.required else ' *'}", check.result.value, check.detail, check.fix or "-")
            for check in self.checks
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
        lines = [
            "  ".join([*(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)), row[3]]).rstrip()
            for row in [header, *rows]
        ]
        where = f"{self.source}, namespace {self.namespace}" if self.source else f"namespace {self.namespace}"
        failing = len(self.failing)
        verdict = (
            f"ready: everything the provider needs is there ({where})"
            if self.ok
            else f"not ready: {failing} check{'s' if failing != 1 else ''} the provider needs failed ({where})"
        )
        return "\n".join([*lines, "", "* optional: does not fail the preflight", verdict]) + "\n"


# --- the RBAC rules: one table for the Role (deploy/rbac.yaml), the UI's Role and the checks --------------------------


@dataclass(frozen=True)
class Rule:
    """One Role rule: an API group, one resource (``pods/log`` for a subresource) and its verbs."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    #: What the provider does with it, for the row's name.
    why: str = ""

    @property
    def plain_resource(self) -> str:
        return self.resource.partition("/")[0]

    @property
    def subresource(self) -> str:
        return self.resource.partition("/")[2]

    def to_yaml_flow(self, verbs: Sequence[str] | None = None) -> str:
        """The rule as one line of YAML (flow style), to paste under a Role's ``rules:``."""
        listed = ", ".join(f'"{verb}"' for verb in (self.verbs if verbs is None else verbs))
        return f'- {{apiGroups: ["{self.group}"], resources: ["{self.resource}"], verbs: [{listed}]}}'


def provider_rules(job_kinds: Iterable[JobKind]) -> tuple[Rule, ...]:
    """The rules the identity of the provider's tasks needs, in the order of ``deploy/rbac.yaml``: the jobs of each
    kind, pods (which the Pod kind's own rule covers, being both), pods' logs and the payload Secret, then what
    ``retry_resources`` (LimitRanges) and ``pending_grace_seconds`` under Kueue (Workloads) read."""
    rules: dict[tuple[str, str], Rule] = {}

    def add(rule: Rule) -> None:
        key = (rule.group, rule.resource)
        if key in rules:
            before = rules[key]
            verbs = (*before.verbs, *(verb for verb in rule.verbs if verb not in before.verbs))
            rules[key] = Rule(before.group, before.resource, verbs, before.why)
        else:
            rules[key] = rule

    job_kinds = tuple(job_kinds)
    for kind in job_kinds:
        add(Rule(kind.group, kind.plural, JOB_VERBS, f"{kind.kind} jobs"))
    for rule in _owner_rules(job_kinds, "objects between"):
        add(rule)
    add(Rule("", "pods", POD_READ_VERBS, "pods of jobs"))
    add(Rule("", "pods/log", ("get",), "pod logs"))
    add(Rule("", "events", ("list",), "why an image pull failed"))
    add(Rule("", "secrets", SECRET_VERBS, "payload Secret"))
    add(Rule("", "limitranges", ("list",), "the memory cap of retry_resources"))
    add(Rule(WORKLOAD_GROUP, WORKLOAD_PLURAL, ("list",), "a Kueue Workload admitted while its job stays suspended"))
    return tuple(rules.values())


def _owner_rules(job_kinds: Iterable[JobKind], why: str) -> list[Rule]:
    """``list`` on the objects between each kind's jobs and their pods (a TrainJob's JobSets and Jobs): the pods'
    controllers are followed through them, by uid, to the job."""
    return [
        Rule(query.group, query.plural, ("list",), f"{why} {kind.kind} jobs and their pods")
        for kind in job_kinds
        for query in kind.intermediates
    ]


def ui_rules(job_kinds: Iterable[JobKind]) -> tuple[Rule, ...]:
    """What the UI's connection reads (``deploy/rbac-ui.yaml``): one list of each job kind and of pods, and rank 0's
    log tail. The Pod kind's list is the pods' list."""
    rules: dict[tuple[str, str], Rule] = {}
    job_kinds = tuple(job_kinds)
    for kind in job_kinds:
        rules.setdefault((kind.group, kind.plural), Rule(kind.group, kind.plural, ("list",), f"UI: {kind.kind} jobs"))
    for rule in _owner_rules(job_kinds, "UI: objects between"):
        rules.setdefault((rule.group, rule.resource), rule)
    rules.setdefault(("", "pods"), Rule("", "pods", ("list",), "UI: pods"))
    rules[("", "pods/log")] = Rule("", "pods/log", ("get",), "UI: pod logs")
    return tuple(rules.values())


# --- one check each: from what the API answered to a row ------------------------------------------------------------


def api_check(kind: JobKind, served: Sequence[str] | None, error: str = "") -> Check:
    """Whether the API serves ``kind``: ``served`` is the group version's resource names (``None``: the group version
    is not served at all; ``error``: discovery itself failed)."""
    name = f"{kind.kind} API {kind.api_version} ({kind.plural})"
    if error:
        return Check(name=name, result=Result.UNKNOWN, detail=f"discovery failed: {error}")
    if served is not None and kind.plural in served:
        return Check(name=name, result=Result.OK, detail="served")
    detail = f"{kind.api_version} not served" if served is None else f"{kind.api_version} served without {kind.plural}"
    return Check(name=name, result=Result.MISSING, detail=detail, fix=_install_fix(kind))


def with_alternatives(apis: Mapping[JobKind, Check], alternatives: Collection[str]) -> dict[str, Check]:
    """The API rows by kind name, an unserved kind of ``alternatives`` (the built-in multi-node kinds) made optional
    where another of them is served: one is enough (a PyTorchJob where Kubeflow Trainer v2 is not installed, or the
    other way round), and the missing one is needed only by tasks that ask for it by ``job_kind``. A plugged-in
    kind stays required: it claims the configs it accepts before any built-in kind does."""
    served = [kind.kind for kind, check in apis.items() if kind.kind in alternatives and check.result is Result.OK]
    rows: dict[str, Check] = {}
    for kind, check in apis.items():
        if check.result is Result.MISSING and kind.kind in alternatives and served:
            detail = f"{check.detail}; {', '.join(served)} served instead: needed only where job_kind asks for it"
            check = replace(check, detail=detail, required=False)
        rows[kind.kind] = check
    return rows


def _install_fix(kind: JobKind) -> str:
    if kind.is_core:
        return f"the cluster's API lacks core {kind.plural}: use a conformant Kubernetes cluster"
    if kind.install_hint:
        return kind.install_hint
    return f"install the CRD {kind.plural}.{kind.group} (version {kind.version}) and the controller of {kind.kind}"


def crd_check(kind: JobKind, crd: Mapping[str, Any] | None, error_status: int = 0, error: str = "") -> Check:
    """The custom kind's CRD and the versions it serves: informational (discovery decides), and unknown when the
    identity may not read CRDs (cluster-scoped: a namespaced Role never grants it)."""
    crd_name = f"{kind.plural}.{kind.group}"
    name = f"{kind.kind} CRD {crd_name}"
    if error_status == 403:
        return Check(name=name, result=Result.UNKNOWN, detail="unknown (no permission)", required=False)
    if error:
        return Check(name=name, result=Result.UNKNOWN, detail=error, required=False)
    if crd is None:
        return Check(name=name, result=Result.MISSING, detail="not installed", fix=_install_fix(kind), required=False)
    versions = [v for v in crd.get("spec", {}).get("versions", []) if isinstance(v, Mapping)]
    served = [str(v.get("name")) for v in versions if v.get("served")]
    detail = f"served versions: {', '.join(served) or 'none'}"
    if kind.version in served:
        return Check(name=name, result=Result.OK, detail=detail, required=False)
    fix = f"serve version {kind.version} of {crd_name}: {_install_fix(kind)}"
    return Check(name=name, result=Result.MISSING, detail=detail, fix=fix, required=False)


def access_check(
    rule: Rule,
    answers: Mapping[str, bool | None],
    *,
    namespace: str,
    required: bool = True,
    errors: Mapping[str, str] | None = None,
) -> Check:
    """One rule from its SelfSubjectAccessReviews: ``answers`` maps each verb to allowed (``None``: not asked or the
    review failed, see ``errors``)."""
    what = f"{rule.group}/{rule.resource}" if rule.group else rule.resource
    # The UI's rows are its own connection's business ([torch_elastic] ui_kubernetes_conn_id), asked of this one.
    name = f"{'RBAC' if required else 'UI RBAC'} {what}: {' '.join(rule.verbs)}"
    denied = [verb for verb in rule.verbs if answers.get(verb) is False]
    unknown = [verb for verb in rule.verbs if answers.get(verb) is None]
    if denied:
        fix = f"add to the identity's Role in {namespace}: {rule.to_yaml_flow(denied)}"
        return Check(name=name, result=Result.MISSING, detail=f"denied: {' '.join(denied)}", fix=fix, required=required)
    if unknown:
        reasons = sorted({(errors or {}).get(verb, "not asked") for verb in unknown})
        detail = f"could not ask for {' '.join(unknown)}: {'; '.join(reasons)}"
        return Check(name=name, result=Result.UNKNOWN, detail=detail, required=required)
    return Check(name=name, result=Result.OK, detail="allowed", required=required)


def smoke_check(image: str | None, *, succeeded: bool, detail: str, submitted: bool = True) -> Check:
    """Whether a one-pod job of ``image`` started, ran the runner and read this provider's payload; ``submitted``
    False: it could not be rendered or created (``detail`` says why), so the image was not tried."""
    name = f"smoke: one-pod job of {image}" if image else "smoke: one-pod job"
    detail = " ".join(detail.split())[:600]  # one line: the runner's report may span several
    if not image:
        fix = "pass --image, or set [torch_elastic] image (AIRFLOW__TORCH_ELASTIC__IMAGE)"
        return Check(name=name, result=Result.MISSING, detail="no image to run", fix=fix)
    if succeeded:
        return Check(name=name, result=Result.OK, detail="the runner read the payload and ran it")
    if not submitted:
        fix = "fix the rows above (the job could not be created)"
        return Check(name=name, result=Result.MISSING, detail=detail, fix=fix)
    fix = (
        f"rebuild {image} with airflow-provider-torchelastic {__version__} (payload format {FORMAT_VERSION}) and "
        "the Airflow workers' Python minor version (docker/Dockerfile); check that the cluster can pull it"
    )
    return Check(name=name, result=Result.MISSING, detail=detail, fix=fix)


def queue_check(queue: str, namespace: str, *, served: bool, found: bool | None, error: str = "") -> Check:
    """Whether the Kueue LocalQueue ``queue`` exists in ``namespace`` (optional: the provider runs without Kueue)."""
    name = f"Kueue LocalQueue {namespace}/{queue}"
    if not served:
        return Check(
            name=name,
            result=Result.MISSING,
            detail=f"Kueue not installed ({KUEUE_GROUP}/{KUEUE_VERSION} not served)",
            fix=f"install Kueue: {KUEUE_INSTALL}",
            required=False,
        )
    if found is None:
        return Check(name=name, result=Result.UNKNOWN, detail=error or "could not read it", required=False)
    if found:
        return Check(name=name, result=Result.OK, detail="exists", required=False)
    fix = (
        f"create it: a {KUEUE_GROUP}/{KUEUE_VERSION} LocalQueue named {queue} in {namespace} with "
        "spec.clusterQueue naming a ClusterQueue"
    )
    return Check(name=name, result=Result.MISSING, detail="not found", fix=fix, required=False)


def version_check(version: Mapping[str, Any] | None, error: str = "") -> Check:
    """The server's version and what the provider does differently on it: nothing, so far; outside the versions the
    rendered objects are validated against, it says so (informational: the provider submits the same objects)."""
    name = "Kubernetes server version"
    if version is None:
        return Check(name=name, result=Result.UNKNOWN, detail=error or "no answer", required=False)
    git_version = str(version.get("gitVersion", "")) or f"{version.get('major', '?')}.{version.get('minor', '?')}"
    match = _MINOR.match(git_version)
    minor = (int(match.group(1)), int(match.group(2))) if match else None
    (low_major, low_minor), (high_major, high_minor) = _TESTED
    tested = f"{low_major}.{low_minor}-{high_major}.{high_minor}"
    # Nothing the provider does depends on the version; a version outside the tested range is worth a note.
    note = "nothing special"
    if minor is not None and not _TESTED[0] <= minor <= _TESTED[1]:
        note += f" (the objects are validated against {tested})"
    return Check(name=name, result=Result.OK, detail=f"{git_version}: {note}", required=False)
