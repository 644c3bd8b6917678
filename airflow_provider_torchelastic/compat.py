"""Every private API of Airflow's that the provider relies on, in one place.

Checked against apache-airflow 3.3.1 (task SDK 1.3.1). cloudpickle's private reconstructors (3.1.3), which the
payload's unpickler needs, are confined to :mod:`airflow_provider_torchelastic.core.unpickle` instead: the runner
loads payloads in images without Airflow, so that one cannot live in this glue module.

Airflow builds a mapped task without running the operator's ``__init__``, so the parse-time checks of a mapped
task (``.partial(...).expand(...)``, ``.expand_kwargs``, ``@task.torch_elastic(...).expand``) need a hook in the
expansion, which Airflow has only as private methods:

- ``OperatorPartial._expand`` and its ``_expand_called`` flag (airflow.sdk.definitions.mappedoperator), which
  ``expand`` and ``expand_kwargs`` both end in; the flag keeps a partial from warning "never mapped";
- ``_TaskDecorator._expand`` (airflow.sdk.bases.decorator), the same for ``@task`` decorators;
- ``DagContext`` and ``TaskGroupContext`` (airflow.sdk.definitions._internal.contextmanager), where such a task
  finds the DAG and task group it is being added to, as Airflow's own expansion does;
- ``ExpandInput`` (airflow.sdk.definitions._internal.expandinput), the type of what is mapped.

Masking by Airflow's secrets-masker rules (:mod:`.operators.masking`) needs ``redact`` and
``should_hide_value_for_key`` of ``airflow.sdk._shared.secrets_masker``, the masker instance the task SDK's own log
uses (``airflow.sdk.log.mask_secret``, which is public, registers into the same one).

When an Airflow upgrade moves one of these, this module is what changes; ``tests/unit/test_operator_parse_checks.py``
and the mapped cases of the decorator's tests fail first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import _TaskDecorator
from airflow.sdk.definitions.mappedoperator import MappedOperator, OperatorPartial

if TYPE_CHECKING:
    from airflow.sdk.definitions._internal.expandinput import ExpandInput
    from airflow.sdk.definitions.xcom_arg import XComArg

__all__ = [
    "CheckedOperatorPartial",
    "CheckedTaskDecorator",
    "ExpandInput",
    "is_sensitive_name",
    "mapped_names",
    "mark_expanded",
    "redact",
]


def redact(value: Any) -> Any:
    """``value`` with every secret this process's maskers know replaced by ``***`` (strings, and dicts and lists
    walked), and the values of keys with sensitive names hidden: the rule Airflow's task log applies.

    Airflow 3.3 has two maskers, each with its own registry: the task SDK's (``airflow.sdk._shared``), which a task
    and the triggerer fill, and the core's (``airflow._shared``), which the api-server fills with the connections and
    variables it reads, and where the UI plugin runs. Both are asked; a secret neither knows stays.
    """
    from airflow.sdk._shared.secrets_masker import redact as _redact

    redacted = _redact(value)
    try:  # checked against apache-airflow-core 3.3
        from airflow._shared.secrets_masker import redact as _redact_core
    except ImportError:  # pragma: no cover - a worker image with the task SDK only
        return redacted
    return _redact_core(redacted)


def is_sensitive_name(name: str) -> bool:
    """Whether Airflow hides the value of a variable, connection extra or env entry called ``name``
    (``[core] sensitive_var_conn_names`` and the built-in names: password, token, secret, api_key...)."""
    from airflow.sdk._shared.secrets_masker import should_hide_value_for_key

    return bool(should_hide_value_for_key(name))


def mapped_names(expand_input: ExpandInput) -> frozenset[str] | None:
    """The argument names an expansion maps, or None when only the run knows them (an XCom of dicts)."""
    value = expand_input.value
    if isinstance(value, Mapping):
        return frozenset(value)
    if isinstance(value, list) and all(isinstance(item, Mapping) for item in value):
        return frozenset(name for item in value for name in item)
    return None


def mark_expanded(partial: OperatorPartial) -> None:
    """Keep a partial that was replaced (not forgotten by the user) from warning "never mapped" when collected."""
    partial._expand_called = True


class CheckedOperatorPartial(OperatorPartial):
    """Airflow's ``OperatorPartial``, whose expansion (``expand`` and ``expand_kwargs`` both end here) first calls
    :meth:`check_expansion` with the names it maps."""

    __slots__ = ()

    def check_expansion(self, mapped: frozenset[str] | None) -> None:
        raise NotImplementedError

    def _expand(self, expand_input: ExpandInput, *, strict: bool) -> MappedOperator:
        self._expand_called = True  # as Airflow's own: a failed expansion is an error, not also "never mapped"
        self.check_expansion(mapped_names(expand_input))
        return OperatorPartial._expand(self, expand_input, strict=strict)


class CheckedTaskDecorator(_TaskDecorator[Any, Any, Any]):
    """Airflow's task decorator, whose mapped expansion first calls :meth:`check_expansion` with every operator
    argument (the DAG and task group included, found as Airflow's expansion finds them)."""

    def check_expansion(self, arguments: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _expand(self, expand_input: ExpandInput, *, strict: bool) -> XComArg:
        from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext

        dag = self.kwargs.get("dag") or DagContext.get_current()
        task_group = self.kwargs.get("task_group") or (TaskGroupContext.get_current(dag) if dag else None)
        self.check_expansion({**self.kwargs, "python_callable": self.function, "dag": dag, "task_group": task_group})
        return super()._expand(expand_input, strict=strict)
