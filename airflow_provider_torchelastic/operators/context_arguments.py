"""The Airflow context's values that a training function's parameters name, as ``@task`` fills them.

``@task`` fills a parameter named as a context key (``def train(epochs, ds=None, params=None)``) from the running
task's context. The training function runs in torch elastic workers, in pods or in processes of their own, where
the runner has neither Airflow nor the context's objects: a key whose value is plain data (a string, a number, a
date, the DAG's params) travels in the payload, converted to standard types; one that is a live Airflow object (the
task instance, the DAG run, connections, variables) cannot, and a parameter that waits for one fails when the DAG is
parsed, saying what to use instead. A ``**kwargs`` parameter receives only the call's own keyword arguments: filling
it with the context, as ``@task`` does, would reach whatever the function passes it on to (a model's constructor).
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

from airflow.sdk.definitions.context import KNOWN_CONTEXT_KEYS

from airflow_provider_torchelastic.operators.exceptions import ConfigurationError

__all__ = ["PLAIN_KEYS", "check_context_parameters", "context_arguments"]

#: The context keys whose values reach the workers: as they are, as standard datetimes (pendulum's would need pendulum
#: where the workers unpickle them), and ``params`` as a dict (Airflow's ``ParamsDict`` would need Airflow).
_AS_IS: Final = frozenset(
    {
        "ds",
        "ds_nodash",
        "ts",
        "ts_nodash",
        "ts_nodash_with_tz",
        "run_id",
        "task_instance_key_str",
        "partition_key",
        "try_number",
        "expanded_ti_count",
        "task_reschedule_count",
        "test_mode",
    }
)
_DATES: Final = frozenset(
    {
        "logical_date",
        "data_interval_start",
        "data_interval_end",
        "prev_data_interval_start_success",
        "prev_data_interval_end_success",
        "prev_start_date_success",
        "prev_end_date_success",
        "partition_date",
    }
)
PLAIN_KEYS: Final = _AS_IS | _DATES | {"params"}
_INSTEAD: Final = (
    "a live Airflow object, which stays on the Airflow worker while the function runs in torch elastic workers; read "
    "airflow_provider_torchelastic.context.current() in the function (dag_id, task_id, run_id, map_index, "
    "try_number, logical_date), or pass what it needs as an argument (a template such as '{{ dag_run.conf }}' is "
    "rendered first); the context keys that reach the workers: "
)


def _unbound(fn: Callable[..., Any], op_args: Collection[Any], op_kwargs: Mapping[str, Any]) -> list[str]:
    """The parameters of ``fn`` that the call leaves unfilled and that Airflow's context names, in order."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing of it names a context key
        return []
    named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p.name for p in named if p.kind is not p.KEYWORD_ONLY][: len(op_args)]
    return [p.name for p in named if p.name in KNOWN_CONTEXT_KEYS and p.name not in {*positional, *op_kwargs}]


def _refusal(names: list[str]) -> str | None:
    """What is wrong with the first of the unfilled parameters ``names`` that waits for a context key that cannot
    reach the workers."""
    for name in names:
        if name not in PLAIN_KEYS:
            return (
                f"python_callable: parameter {name!r} waits for Airflow's context[{name!r}], {_INSTEAD}"
                f"{', '.join(sorted(PLAIN_KEYS))}"
            )
    return None


def check_context_parameters(fn: object, op_args: object, op_kwargs: object) -> None:
    """A TypeError when a parameter of ``fn`` waits for a context key that cannot reach the workers.

    Arguments only the run knows (a mapped or XCom ``op_args``/``op_kwargs``) are checked then, by
    :func:`context_arguments`."""
    if callable(fn) and isinstance(op_args, list | tuple) and isinstance(op_kwargs, Mapping):
        refusal = _refusal(_unbound(fn, op_args, op_kwargs))
        if refusal is not None:
            raise TypeError(refusal)


def context_arguments(
    fn: Callable[..., Any], op_args: Collection[Any], op_kwargs: Mapping[str, Any], context: Mapping[str, Any]
) -> dict[str, Any]:
    """``op_kwargs`` with the context's values for the parameters of ``fn`` that name a plain key and that the call
    leaves unfilled; a key the context lacks is None, as ``@task`` makes it. A parameter that waits for a live
    object (known only now, for a mapped task) is a :class:`ConfigurationError`: no retry can fill it."""
    names = _unbound(fn, op_args, op_kwargs)
    refusal = _refusal(names)
    if refusal is not None:
        raise ConfigurationError(refusal)
    return {**{name: _plain(name, _value(context, name)) for name in names}, **op_kwargs}


def _value(context: Mapping[str, Any], name: str) -> Any:
    if name == "try_number" and name not in context:
        # Declared by Airflow's Context, but the task runner leaves it to the task instance.
        return getattr(context.get("ti"), "try_number", None)
    return context.get(name)


def _plain(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in _DATES:
        # pendulum's DateTime is a datetime; its class is pendulum's. The same instant, with its UTC offset.
        return datetime.datetime.fromisoformat(value.isoformat())
    if name == "params":
        return {key: value[key] for key in value}  # ParamsDict's items are Param objects; its values are resolved
    return value
