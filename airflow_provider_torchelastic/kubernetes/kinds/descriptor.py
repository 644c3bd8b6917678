"""What the provider needs to know about one kind of job: the descriptor each kind's module fills in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from airflow_provider_torchelastic.core.config import TaskConfig
from airflow_provider_torchelastic.core.naming import TRAINING_CONTAINER
from airflow_provider_torchelastic.errors import KubeError
from airflow_provider_torchelastic.kubernetes.ownership import controlled_pods, uid_of
from airflow_provider_torchelastic.kubernetes.pod_template import RenderInputs
from airflow_provider_torchelastic.kubernetes.wait_types import JobRef, Snapshot, WaitDecision, WaitPolicy

__all__ = ["DENIED", "NOT_SERVED", "JobKind", "OwnerQuery", "PodsOf"]

JsonDict = dict[str, Any]
#: Why a list of a custom kind may be passed over (:meth:`JobKind.unlisted_because`).
NOT_SERVED = "not served"
DENIED = "denied"


def _unchanged(manifest: JsonDict) -> JsonDict:
    return manifest


def _no_replica_count(job: Mapping[str, Any]) -> int | None:
    return None


def _no_selector(name: str) -> str | None:
    return None


def _none_by_replica(workload: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _by_name(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    return (str((pod.get("metadata") or {}).get("name", "")),)


def _controlled(
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    chain: Sequence[str],
    owners: Sequence[Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    between = {uid: owner for owner in owners if (uid := uid_of(owner)) is not None}
    return controlled_pods(job, pods, chain, between)


@functools.lru_cache(maxsize=4096)
def _selector_labels(selector: str) -> Mapping[str, str]:
    # Read for every pod a snapshot looks at, by every trigger of a shared watch: parsed once per selector.
    terms = (term.partition("=") for term in selector.split(",") if term)
    return MappingProxyType({key.strip(): value.strip() for key, _, value in terms})


@dataclass(frozen=True, kw_only=True)
class PodsOf:
    """The pods of one job, in the two forms its readers need: the label selector a list or watch sends to the API,
    and the same choice made over pods already at hand (the shared watch's cache, the UI's one pod list of a
    namespace). One answer (:meth:`JobKind.pods_of`), so that a poll, the watch and the UI never disagree.

    Labels find the pods; only the job's controller ownerReferences, followed by uid (:mod:`..ownership`), make them
    the job's: labels are anyone's to set.
    """

    #: The label selector of the job's pods (equality terms, ``k=v,k2=v2``); None when the job object is its own
    #: only pod (a bare Pod job).
    selector: str | None
    #: The kinds of the controllers from a pod up to the job (:attr:`JobKind.controller_chain`).
    chain: tuple[str, ...]

    @property
    def labels(self) -> Mapping[str, str]:
        """The selector's terms as labels a pod must carry (none for a job that is its own pod)."""
        return _selector_labels(self.selector or "")

    def labelled(self, pod: Mapping[str, Any]) -> bool:
        """Whether ``pod`` carries the labels the selector asks for (what the API would have listed)."""
        if self.selector is None:
            return False
        found = (pod.get("metadata") or {}).get("labels") or {}
        return all(found.get(key) == value for key, value in self.labels.items())

    def pick(
        self,
        job: Mapping[str, Any] | None,
        pods: Iterable[Mapping[str, Any]],
        owners: Sequence[Mapping[str, Any]] = (),
    ) -> list[Mapping[str, Any]]:
        """The pods of ``pods`` that are ``job``'s: labelled as the selector asks and controlled by the job through
        :attr:`chain` (``owners``: the objects between, by uid, for a chain of more than one hop). A job that is its
        own only pod is its own list; no job, no pods."""
        if self.selector is None:
            return [job] if job is not None else []
        return _controlled(job, [pod for pod in pods if self.labelled(pod)], self.chain, owners)


@dataclass(frozen=True, kw_only=True)
class OwnerQuery:
    """Objects between a job and its pods (a TrainJob's JobSet and its Jobs), read beside the pods so that each pod's
    controller chain can be followed by uid up to the job. Selected by label, or by field, from the job's name."""

    group: str
    version: str
    plural: str
    label_selector: Callable[[str], str | None] = _no_selector
    field_selector: Callable[[str], str | None] = _no_selector


@dataclass(frozen=True, kw_only=True)
class JobKind:
    """One kind of job: where the API keeps it, how a task config becomes one, how to find its pods, and how to read
    what it says. Everything that differs between kinds is here, so that no other module tests kind names."""

    #: The object's ``kind``, e.g. ``PyTorchJob``; also its key in the table of kinds.
    kind: str
    #: API group (``""`` for the core group), version and plural, as in the resource's URL.
    group: str
    version: str
    plural: str
    #: Whether this kind runs a task config; the first kind in the table that accepts it renders it.
    accepts: Callable[[TaskConfig], bool]
    #: The job object from the shared render inputs (name, namespace, image, pod options, labels...).
    render: Callable[[RenderInputs], JsonDict]
    #: The label selector of the job's pods, given the job's name; ``None`` when the object is its own only pod.
    pod_selector: Callable[[str], str | None]
    #: Where the job stands, from a snapshot of it and its pods.
    decide: Callable[[JobRef, Snapshot, WaitPolicy], WaitDecision]
    #: Whether the job itself says it has ended (whatever the pods still do): a finished job is never deleted by a
    #: late kill, so that ``on_finish_action="keep"`` keeps it.
    is_finished: Callable[[Mapping[str, Any]], bool]
    #: The pod label whose value is the job's name (what :attr:`pod_selector` selects on), so that a watch of all
    #: pods can file each pod under its job without a request; ``None`` when the object is its own only pod.
    pod_owner_label: str | None = None
    #: The container whose log is the training's (rank 0's result lines, metrics, failures).
    log_container: str = TRAINING_CONTAINER
    #: How to read the objects between the job and its pods, when :attr:`pod_controllers` has more than one hop.
    intermediates: tuple[OwnerQuery, ...] = ()
    #: The kinds of the controllers from a pod up to the job (nearest first, this kind last), which a pod's
    #: ``controller: true`` ownerReferences must follow, by uid, to be the job's (:mod:`..ownership`). ``()``: the
    #: object is its own only pod. None (the default): one hop, the pod's controller is the job itself. A
    #: TrainJob's would be ``("Job", "JobSet", "TrainJob")``.
    pod_controllers: tuple[str, ...] | None = None
    #: The sort key of a job's pods, in the order a person reads them (rank 0's pod first where the kind knows it):
    #: the UI's pod lists and log tails. By name unless the kind says more.
    pod_order: Callable[[Mapping[str, Any]], tuple[Any, ...]] = _by_name
    #: How many pods the job asks for, read from its spec (the UI's pod count before they all exist); ``None``
    #: where the spec does not say (the pods are counted instead).
    replica_count: Callable[[Mapping[str, Any]], int | None] = _no_replica_count
    #: The training container of each replica of a rendered object, by replica name: the dicts themselves (so that a
    #: copy's can be changed in place), whose :attr:`resources_key` holds the resources ``retry_resources`` raises.
    training_containers: Callable[[Mapping[str, Any]], dict[str, Any]] = _none_by_replica
    resources_key: str = "resources"
    #: The pod templates of a rendered object that the kind's controller makes pods from, by replica name. Each is
    #: created as a dry-run Pod before the job (:func:`~..submit.create_or_reattach`): the API server validates a
    #: custom resource's templates only against its schema, so a template it would refuse as a Pod would leave the
    #: job without pods. None where the object is the pod, or the controller composes the pods itself.
    pod_templates: Callable[[Mapping[str, Any]], dict[str, Any]] = _none_by_replica
    #: The rendered object with its repetition folded, for the rendered-template view when the whole does not fit.
    abbreviate: Callable[[JsonDict], JsonDict] = _unchanged
    #: The ``spec`` of the object's digest (what runs where, with which resources): the last resort of that view.
    digest_spec: Callable[[JsonDict], JsonDict] = _unchanged
    #: What serves this kind in a cluster (``the Kubeflow training operator``), for the messages about a cluster
    #: that lacks it or refused a job; ``None``: "the controller of <kind>".
    controller: str | None = None
    #: The preflight's fix where the kind's API is not served (``install ...``); ``None``: install its CRD and a
    #: controller.
    install_hint: str | None = None
    #: What an admission webhook's refusal of this kind most often means, beyond its own message; ``None``: nothing.
    refusal_hint: str | None = None

    def __post_init__(self) -> None:
        if self.pod_controllers != () and not self.pod_owner_label:
            # Polls would find the pods by pod_selector, but the triggerer's shared watch of all pods files them
            # under their job by this label: without it a deferred task would never see its job's pods.
            raise ValueError(
                f"JobKind {self.kind}: pod_owner_label: expected the pod label whose value is the job's name (what "
                "pod_selector selects on), got None; only a kind whose object is its own pod (pod_controllers=()) "
                "goes without"
            )
        if len(self.controller_chain) > 1 and not self.intermediates:
            # Without the objects in between, no pod's chain can be followed to the job: it would have no pods.
            raise ValueError(
                f"JobKind {self.kind}: intermediates: expected an OwnerQuery for the objects between the pods and the "
                f"job (pod_controllers={self.pod_controllers}), got none"
            )

    @property
    def served_by(self) -> str:
        return self.controller or f"the controller of {self.kind}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def is_core(self) -> bool:
        return not self.group

    def unlisted_because(self, error: KubeError) -> str | None:
        """Why a list of this kind that failed with ``error`` may be passed over, the other kinds still read:
        :data:`NOT_SERVED` (404: its CRD is not installed, so nothing of it runs) or :data:`DENIED` (403: a Role
        written before this kind was one, or for a cluster without it; the caller says so). None for a core kind
        and for any other error: raise it."""
        if self.is_core:
            return None
        if error.not_found:
            return NOT_SERVED
        return DENIED if error.status == 403 else None

    @property
    def controller_chain(self) -> tuple[str, ...]:
        """:attr:`pod_controllers`, with its default filled in."""
        return self.pod_controllers if self.pod_controllers is not None else (self.kind,)

    def pods_of(self, name: str) -> PodsOf:
        """The pods of job ``name``: the selector to send to the API, and the same choice over pods at hand."""
        return PodsOf(selector=self.pod_selector(name), chain=self.controller_chain)

    def owner_of(self, pod: Mapping[str, Any]) -> str | None:
        """The name of the job of this kind that ``pod``'s labels file it under (:attr:`pod_owner_label`), or None:
        how a watch of all pods files an event under its job without a request."""
        if self.pod_owner_label is None:
            return None
        owner = ((pod.get("metadata") or {}).get("labels") or {}).get(self.pod_owner_label)
        return str(owner) if owner is not None else None

    def owner_reference(self, *, owner_name: str, owner_uid: str) -> JsonDict:
        """The merge-patch body that makes an object (the payload Secret) a dependent of this kind's job.

        Set after the job exists (its uid is known only then). No ``blockOwnerDeletion``: setting it needs permission
        on the owner's finalizers, and nothing is gained by blocking the owner's deletion on a Secret.
        """
        if not owner_name or not owner_uid:
            raise ValueError(f"owner_name and owner_uid: expected non-empty strings, got {owner_name!r}, {owner_uid!r}")
        owner = {"apiVersion": self.api_version, "kind": self.kind, "name": owner_name, "uid": owner_uid}
        return {"metadata": {"ownerReferences": [owner]}}
