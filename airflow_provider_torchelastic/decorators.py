"""``@task.torch_elastic``: the TaskFlow spelling of :class:`TorchElasticOperator`.

Registered through the provider's ``task-decorators``; ``multiple_outputs`` and ``.expand()`` work as with ``@task``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from airflow_provider_torchelastic.operators import TorchElasticOperator

__all__ = ["torch_elastic_task"]


class _TorchElasticDecoratedOperator(DecoratedOperator, TorchElasticOperator):
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


def torch_elastic_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Run the decorated function under torch elastic; takes :class:`TorchElasticOperator`'s arguments."""
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_TorchElasticDecoratedOperator,
        **kwargs,
    )
