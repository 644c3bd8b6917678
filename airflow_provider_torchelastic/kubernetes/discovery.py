"""What the preflight asks the cluster before any job: discovery, access reviews, the version, definitions.

Calls as data (:class:`~.calls.Call`), sent by either client's ``send``: ``kube.send(discovery.server_version())``.
The job's own verbs are in :mod:`~.calls`; these are apart because only the preflight (and the operator's
``job_kind="auto"``, through :func:`served_resources`) asks them.
"""

from __future__ import annotations

from typing import Any, Final

from airflow_provider_torchelastic.kubernetes.calls import (
    Call,
    JsonDict,
    collection_path,
    group_path,
    json_object,
    segments,
)

__all__ = ["access_review", "crd", "custom_object", "served_resources", "server_version"]

_SELF_SUBJECT_ACCESS_REVIEWS: Final = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_CRDS: Final = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _resource_names(body: bytes) -> list[str]:
    return [str(resource.get("name", "")) for resource in json_object(body).get("resources", [])]


def served_resources(group: str, version: str) -> Call[list[str] | None]:
    """The resource names the API serves in ``group``/``version`` (``""``: the core group), subresources included
    (``pods/log``); None when the group version is not served at all."""
    if not group and version != "v1":  # pragma: no cover - the core group has one version
        raise ValueError(f"version: the core group serves v1, got {version!r}")
    return Call(method="GET", path=group_path(group, version), parse=_resource_names, missing=None)


def _allowed(body: bytes) -> bool:
    return bool(json_object(body).get("status", {}).get("allowed", False))


def access_review(verb: str, resource: str, group: str, namespace: str, subresource: str = "") -> Call[bool]:
    """Whether this identity may ``verb`` the ``resource`` (``subresource``) of ``group`` in ``namespace``: one
    SelfSubjectAccessReview (authorization.k8s.io/v1), which any authenticated identity may create."""
    attributes = {"verb": verb, "resource": resource, "group": group, "namespace": namespace}
    if subresource:
        attributes["subresource"] = subresource
    body: dict[str, Any] = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes},
    }
    return Call(method="POST", path=_SELF_SUBJECT_ACCESS_REVIEWS, body=body, parse=_allowed)


def server_version() -> Call[JsonDict]:
    """``/version``: ``gitVersion``, ``major``, ``minor``..."""
    return Call(method="GET", path="/version/", parse=json_object)


def crd(name: str) -> Call[JsonDict | None]:
    """The CustomResourceDefinition ``name`` (``plural.group``); None when it is not installed."""
    return Call(method="GET", path=_CRDS + segments(name), parse=json_object, missing=None)


def custom_object(group: str, version: str, plural: str, name: str, namespace: str) -> Call[JsonDict | None]:
    """One namespaced custom object that is no job kind (a Kueue LocalQueue); None when it does not exist."""
    path = collection_path(group, version, plural, namespace) + segments(name)
    return Call(method="GET", path=path, parse=json_object, missing=None)
