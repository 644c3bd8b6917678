"""The checks of where a pod may be scheduled: its ``affinity`` by the rules of the API server's ``validateAffinity``
(node, pod and pod anti-affinity), its ``topologySpreadConstraints`` by ``validateTopologySpreadConstraints``, so that a
weight of 0 or an operator's missing values fail while the DAG file is parsed instead of when the pod (or, for a
PyTorchJob, every pod the training operator tries to create) is refused.

Only the fields Kubernetes validates are checked (the API server, and the scheduler for the node terms' values it
must parse); fields this module does not know are kept as given (a newer API server may take them). Pure and standard
library only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeAlias, cast

from airflow_provider_torchelastic.core.naming import DNS_1123_LABEL, DNS_1123_SUBDOMAIN
from airflow_provider_torchelastic.core.pod_fields import (
    JsonDict,
    check_keys,
    check_label_key,
    check_label_value,
    check_labels,
    check_mapping,
)
from airflow_provider_torchelastic.core.validation import fail, is_int

__all__ = ["AFFINITY_KEYS", "check_affinity", "check_topology_spread"]

AFFINITY_KEYS: Final = frozenset({"nodeAffinity", "podAffinity", "podAntiAffinity"})
#: A check of one mapping: (owner, its name for messages, the mapping).
_Check: TypeAlias = Callable[[str, str, JsonDict], None]
_REQUIRED: Final = "requiredDuringSchedulingIgnoredDuringExecution"
_PREFERRED: Final = "preferredDuringSchedulingIgnoredDuringExecution"
_SOME: Final = (1, None, "at least one value")
_NONE: Final = (0, 0, "no values")
_ONE: Final = (1, 1, "exactly one value")
#: Operators and how many values each takes: (at least, at most, what that is in words).
_LABEL_OPERATORS: Final = {"In": _SOME, "NotIn": _SOME, "Exists": _NONE, "DoesNotExist": _NONE}
_NODE_OPERATORS: Final = {**_LABEL_OPERATORS, "Gt": _ONE, "Lt": _ONE}
#: A node field selector takes one field, the node's name, and exactly one value.
_FIELD_OPERATORS: Final = {"In": _ONE, "NotIn": _ONE}
_WHEN_UNSATISFIABLE: Final = ("DoNotSchedule", "ScheduleAnyway")
#: A ``Gt``/``Lt`` value: what Go's ``strconv.ParseInt(value, 10, 64)`` takes.
_INTEGER: Final = re.compile(r"[+-]?[0-9]+\Z")
_INT64: Final = range(-(2**63), 2**63)


def check_affinity(owner: str, name: str, value: object) -> Mapping[str, Any]:
    """``value`` as a plain mapping (None fields dropped), or the error naming the first field Kubernetes refuses."""
    affinity = _dict(owner, name, value)
    check_keys(owner, name, affinity, AFFINITY_KEYS)
    for key, part in affinity.items():
        where = f"{name}.{key}"
        part = affinity[key] = _dict(owner, where, part)
        node = key == "nodeAffinity"
        if _REQUIRED in part and node:  # one selector, its terms ORed
            _node_selector(owner, f"{where}.{_REQUIRED}", part[_REQUIRED])
        elif _REQUIRED in part:  # a list of terms, ANDed
            _each(owner, f"{where}.{_REQUIRED}", part[_REQUIRED], _pod_term)
        if _PREFERRED in part:
            weighted = _weighted("preference", _node_term) if node else _weighted("podAffinityTerm", _pod_term)
            _each(owner, f"{where}.{_PREFERRED}", part[_PREFERRED], weighted)
    return MappingProxyType(affinity)


def _dict(owner: str, name: str, value: object) -> JsonDict:
    if value is None:
        return {}
    plain = check_mapping(owner, name, value)
    return {key: val for key, val in plain.items() if val is not None}


def _each(owner: str, name: str, value: object, check: _Check) -> None:
    if not isinstance(value, list):
        raise fail(owner, name, value, "a list", TypeError)
    for index, item in enumerate(value):
        check(owner, f"{name}[{index}]", _dict(owner, f"{name}[{index}]", item))


def _node_selector(owner: str, name: str, value: object) -> None:
    selector = _dict(owner, name, value)
    terms = selector.get("nodeSelectorTerms")
    if not terms:
        raise fail(owner, f"{name}.nodeSelectorTerms", terms, "at least one node selector term")
    _each(owner, f"{name}.nodeSelectorTerms", terms, _node_term)


def _node_term(owner: str, name: str, term: JsonDict) -> None:
    _each(owner, f"{name}.matchExpressions", term.get("matchExpressions", []), _requirement(_NODE_OPERATORS))
    _each(owner, f"{name}.matchFields", term.get("matchFields", []), _requirement(_FIELD_OPERATORS, fields=True))


def _weighted(inner: str, check_term: _Check) -> _Check:
    """The check of one weighted term: a weight from 1 to 100 and its ``inner`` term."""

    def check(owner: str, name: str, item: JsonDict) -> None:
        weight = item.get("weight")
        if not is_int(weight) or not 1 <= cast("int", weight) <= 100:
            exc = ValueError if is_int(weight) else TypeError
            raise fail(owner, f"{name}.weight", weight, "an int from 1 to 100", exc)
        if inner not in item:  # the CRDs' schemas require it (a Pod alone would take an empty term)
            raise fail(owner, f"{name}.{inner}", None, f"a {inner} mapping")
        check_term(owner, f"{name}.{inner}", _dict(owner, f"{name}.{inner}", item[inner]))

    return check


def _pod_term(owner: str, name: str, term: JsonDict) -> None:
    for key in ("labelSelector", "namespaceSelector"):
        if key in term:
            _label_selector(owner, f"{name}.{key}", _dict(owner, f"{name}.{key}", term[key]))
    for key in ("matchLabelKeys", "mismatchLabelKeys"):
        _label_keys(owner, f"{name}.{key}", term.get(key, []))
    namespaces = term.get("namespaces", [])
    if not isinstance(namespaces, list):
        raise fail(owner, f"{name}.namespaces", namespaces, "a list of namespace names", TypeError)
    for index, namespace in enumerate(namespaces):
        if not isinstance(namespace, str) or not DNS_1123_LABEL.match(namespace):
            raise fail(owner, f"{name}.namespaces[{index}]", namespace, "a namespace name (a DNS-1123 label)")
    _topology_key(owner, name, term.get("topologyKey"), "kubernetes.io/hostname")


def _topology_key(owner: str, name: str, key: object, example: str) -> str:
    """A pod term's or spread constraint's ``topologyKey``: required, and a label key."""
    if not key:
        raise fail(owner, f"{name}.topologyKey", key, f"a node label key such as {example!r}")
    return check_label_key(owner, f"{name}.topologyKey", key)


def _label_selector(owner: str, name: str, selector: JsonDict) -> None:
    if "matchLabels" in selector:
        check_labels(owner, f"{name}.matchLabels", selector["matchLabels"], reserved_ok=True)
    _each(owner, f"{name}.matchExpressions", selector.get("matchExpressions", []), _requirement(_LABEL_OPERATORS))


def _label_keys(owner: str, name: str, keys: object) -> None:
    """A ``matchLabelKeys`` (or ``mismatchLabelKeys``): the keys of the pod's own labels a selector adds."""
    if not isinstance(keys, list):
        raise fail(owner, name, keys, "a list of label keys", TypeError)
    for index, key in enumerate(keys):
        check_label_key(owner, f"{name}[{index}]", key)


def _requirement(operators: Mapping[str, tuple[int, int | None, str]], *, fields: bool = False) -> _Check:
    """The check of one ``{key, operator, values}`` requirement with these operators (a node field's, if ``fields``)."""

    def check(owner: str, name: str, requirement: JsonDict) -> None:
        key, operator, values = requirement.get("key"), requirement.get("operator"), requirement.get("values", [])
        if not isinstance(operator, str) or operator not in operators:
            raise fail(owner, f"{name}.operator", operator, "one of " + ", ".join(operators))
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise fail(owner, f"{name}.values", values, "a list of str", TypeError)
        least, most, expected = operators[operator]
        if len(values) < least or (most is not None and len(values) > most):
            raise fail(owner, f"{name}.values", values, f"{expected} with operator {operator}")
        if fields:
            if key != "metadata.name":
                raise fail(owner, f"{name}.key", key, "'metadata.name' (the one node field a selector may match)")
            if not DNS_1123_SUBDOMAIN.match(values[0]):
                raise fail(owner, f"{name}.values[0]", values[0], "a node name (a DNS subdomain)")
        else:
            check_label_key(owner, f"{name}.key", key)
            for index, value in enumerate(values):
                _requirement_value(owner, f"{name}.values[{index}]", operator, value)

    return check


def _requirement_value(owner: str, name: str, operator: str, value: str) -> None:
    """A value the scheduler can compare with a label. The API server lets a node term's through, but the scheduler
    parses every term into a label selector and a term it cannot parse matches no node: a required one leaves the pod
    Pending for good. A pod term's values the API server itself checks (1.27 and later)."""
    if operator not in ("Gt", "Lt"):
        check_label_value(owner, name, value)
    elif not _INTEGER.match(value) or int(value) not in _INT64:
        raise fail(owner, name, value, f"an integer (operator {operator} compares a node label's value as a number)")


def check_topology_spread(owner: str, name: str, value: object) -> None:
    """Each constraint's ``maxSkew`` (> 0), ``topologyKey``, ``whenUnsatisfiable``, ``labelSelector``,
    ``matchLabelKeys`` and ``minDomains`` (> 0, with DoNotSchedule only); no two of one key and one
    ``whenUnsatisfiable``."""
    seen: set[tuple[str, str]] = set()

    def check(owner: str, name: str, constraint: JsonDict) -> None:
        skew = constraint.get("maxSkew")
        if not is_int(skew) or cast("int", skew) < 1:
            raise fail(owner, f"{name}.maxSkew", skew, "an int >= 1")
        key = _topology_key(owner, name, constraint.get("topologyKey"), "topology.kubernetes.io/zone")
        when = constraint.get("whenUnsatisfiable")
        if when not in _WHEN_UNSATISFIABLE:
            raise fail(owner, f"{name}.whenUnsatisfiable", when, "one of " + ", ".join(_WHEN_UNSATISFIABLE))
        if (key, when) in seen:
            raise fail(owner, name, constraint, "one constraint per topologyKey and whenUnsatisfiable")
        seen.add((key, when))
        if "labelSelector" in constraint:  # the API server checks it since 1.27, by the pod terms' rules
            where = f"{name}.labelSelector"
            _label_selector(owner, where, _dict(owner, where, constraint["labelSelector"]))
        _label_keys(owner, f"{name}.matchLabelKeys", constraint.get("matchLabelKeys", []))
        domains = constraint.get("minDomains")
        if domains is not None and (not is_int(domains) or domains < 1 or when != "DoNotSchedule"):
            raise fail(owner, f"{name}.minDomains", domains, "an int >= 1, with whenUnsatisfiable DoNotSchedule")

    _each(owner, name, value, check)
