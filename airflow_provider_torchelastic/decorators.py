"""``@task.torch_elastic``: the TaskFlow spelling of :class:`TorchElasticOperator`.

Registered through the provider's ``task-decorators``; ``multiple_outputs`` and ``.expand()`` work as with ``@task``.
A mapped call (``.expand``, ``.partial(...).expand``, ``.expand_kwargs``) runs the operator's parse-time checks on
the decorator's arguments, as an unmapped call does through the constructor.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, cast

import attr
from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator

from airflow_provider_torchelastic.compat import CheckedTaskDecorator
from airflow_provider_torchelastic.operators import TorchElasticOperator
from airflow_provider_torchelastic.operators.arguments import check_mapped_arguments

__all__ = ["torch_elastic_task"]


# The operator's python_callable may be None (module=/script= in its place); the decorator's never is, which is all
# DecoratedOperator's narrower declaration says.
class _TorchElasticDecoratedOperator(DecoratedOperator, TorchElasticOperator):  # type: ignore[misc]
    custom_operator_name = "@task.torch_elastic"
    template_fields: Sequence[str] = TorchElasticOperator.template_fields
    template_fields_renderers: ClassVar[dict[str, str]] = TorchElasticOperator.template_fields_renderers

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # DecoratedOperator checks the call against the function's signature, then passes these on to
        # TorchElasticOperator, which owns them.
        kwargs_to_upstream = {"python_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs}
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            kwargs_to_upstream=kwargs_to_upstream,
            **kwargs,
        )


class _TorchElasticTaskDecorator(CheckedTaskDecorator):
    """Airflow's task decorator, whose mapped expansion first checks the operator's arguments.

    A mapped decorated task maps only the function's arguments (``op_kwargs``), so every operator argument is known
    here: given to the decorator, to ``.override()``, or by the DAG's ``default_args``.
    """

    def check_expansion(self, arguments: Mapping[str, Any]) -> None:
        check_mapped_arguments(arguments, mapped={"op_kwargs"})


def torch_elastic_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Run the decorated function under torch elastic; takes :class:`TorchElasticOperator`'s arguments.

    Airflow's ``task_decorator_factory``, with a decorator class whose ``.expand`` checks the arguments.
    """
    outputs = cast(bool, attr.NOTHING) if multiple_outputs is None else multiple_outputs

    def decorate(function: Callable[..., Any]) -> _TorchElasticTaskDecorator:
        return _TorchElasticTaskDecorator(
            function=function,
            multiple_outputs=outputs,
            operator_class=_TorchElasticDecoratedOperator,
            kwargs=dict(kwargs),
        )

    if python_callable is None:
        return cast(TaskDecorator, decorate)
    if not callable(python_callable):
        raise TypeError("No positional arguments allowed while using @task, use named arguments instead")
    return cast(TaskDecorator, decorate(python_callable))
