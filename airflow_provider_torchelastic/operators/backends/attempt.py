"""A try as every backend sees it (:class:`~.base.Attempt`): its identity, the run context its workers read, and
its payload, built once by the operator from the rendered task. A dry run builds a placeholder try the same way,
writing nothing.

A try renders its objects from these alone, so a worker that re-attaches after a crash renders the same objects.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any, cast

from airflow_provider_torchelastic.core.naming import RunIdentity, placeholder_identity
from airflow_provider_torchelastic.core.run_context import TaskContext, artifact_location, checkpoint_location
from airflow_provider_torchelastic.core.validation import is_templated
from airflow_provider_torchelastic.kubernetes import render as kubernetes_render
from airflow_provider_torchelastic.operators.backends.base import Attempt, TaskSpec
from airflow_provider_torchelastic.operators.context_arguments import context_arguments
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.operators.spill import ARGUMENTS_FOLDER, MAX_PAYLOAD_BYTES, dump_try_payload

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_provider_torchelastic.settings import Settings

__all__ = ["identity_of", "new_attempt", "task_context_of"]


def identity_of(context: Context | None, task: TaskSpec | None = None) -> RunIdentity:
    """The try's identity from its context; outside one (a dry run), a placeholder run's of ``task``."""
    if context is None:
        assert task is not None, "a dry run names its task"
        return placeholder_identity(task.dag_id, task.task_id)
    ti = context["ti"]
    return RunIdentity(
        dag_id=ti.dag_id,
        task_id=ti.task_id,
        run_id=ti.run_id,
        map_index=ti.map_index if ti.map_index is not None else -1,
        try_number=ti.try_number,
    )


def new_attempt(
    task: TaskSpec,
    call: tuple[Callable[..., Any], Collection[Any], Mapping[str, Any]],
    context: Context | None,
    settings: Settings,
    *,
    dry_run: bool = False,
) -> Attempt:
    """The try of ``task`` that ``context`` runs calling ``call``, the function with its arguments; with
    ``dry_run``, one shown without running it (``context`` None: a placeholder run's). Its payload spills large
    arguments to artifact storage; a dry run's spills them into nothing (:func:`_check_dry_run_payload`)."""
    identity = identity_of(context, task)
    task_context = task_context_of(identity, context, task.checkpoint_uri, settings)
    fn, args, kwargs = call
    if context is not None:
        kwargs = context_arguments(fn, args, kwargs, context)
    would_write: list[str] = []
    payload = dump_try_payload(
        fn,
        args,
        kwargs,
        storage=settings.artifact_storage,
        task_context=task_context,
        open_write=functools.partial(_write_nothing, would_write) if dry_run else None,
        trusted_roots=task.trusted_artifact_roots,
        allow_pickles=task.allow_pickled_artifacts,
    )
    if dry_run:
        _check_dry_run_payload(payload, would_write, task_context)
    return Attempt(identity, task_context, settings, payload, context=context, dry_run=dry_run)


def task_context_of(
    identity: RunIdentity, context: Context | None, checkpoint_uri: str | None, settings: Settings
) -> TaskContext:
    """What every worker of this try sees as its run context (``TORCHELASTIC_CONTEXT``): the same for every
    rendering of the try, so that a re-attaching worker renders the same manifest."""
    if checkpoint_uri is not None and (is_templated(checkpoint_uri) or not checkpoint_uri):
        raise ConfigurationError(f"checkpoint_uri: expected a path or fsspec URL, got {checkpoint_uri!r}")
    root = settings.checkpoint_root
    if checkpoint_uri is None and root is not None:
        checkpoint_uri = checkpoint_location(
            root,
            dag_id=identity.dag_id,
            run_id=identity.run_id,
            task_id=identity.task_id,
            map_index=identity.map_index,
        )
    # What the identity alone gives (render_manifests without a run uses the same), then what the run knows.
    task_context = replace(kubernetes_render.task_context_for(identity), checkpoint_uri=checkpoint_uri)
    if settings.artifact_storage is not None:
        task_context = replace(
            task_context, artifact_uri=artifact_location(settings.artifact_storage.url, task_context)
        )
    if context is None:
        return task_context
    logical_date = context.get("logical_date")
    return replace(
        task_context,
        max_tries=int(getattr(context["ti"], "max_tries", 0) or 0),
        logical_date=logical_date.isoformat() if logical_date is not None else None,
        resume_from=_resume_from(context, task_context),
    )


def _resume_from(context: Context, task_context: TaskContext) -> str | None:
    """The task's ``resume_from`` as rendered for this try, checked again now that a template has its value; the
    workers resolve it (they read the stores, with their own credentials)."""
    from airflow_provider_torchelastic.operators.arguments import check_resume_from

    value = getattr(context.get("task"), "resume_from", None)
    if value is None:
        return None
    try:
        value = check_resume_from(value)
    except (TypeError, ValueError) as e:
        raise ConfigurationError(str(e)) from e
    if value is not None and (is_templated(value) or task_context.checkpoint_uri is None):
        raise ConfigurationError(
            f"resume_from={value!r}: "
            + (
                "it renders to another template"
                if is_templated(value)
                else "this task has no checkpoint location to resume into: set [torch_elastic] checkpoint_root"
            )
        )
    if value == task_context.run_id:
        return None  # this run's own checkpoints are where every try looks first anyway
    return value


class _Discarded(io.RawIOBase):
    """A file that keeps nothing: what a dry run spills arguments into."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def _write_nothing(would_write: list[str], url: str) -> IO[bytes]:
    """What a dry run spills arguments into: nothing, remembering the URL a run would write."""
    would_write.append(url)
    return cast("IO[bytes]", _Discarded())


def _check_dry_run_payload(payload: bytes, would_write: list[str], task_context: TaskContext) -> None:
    """The payload a run would submit was made without writing to storage: arguments over the payload's limit were
    spilled as a run spills them, but into nothing, so the payload names the files a run would write (their URLs,
    sizes and sha256s) and a ``UserWarning`` says they do not exist. Over the limit with no artifact location to
    spill to, a run would fail at submit: ``ValueError`` naming the option that fixes it."""
    if would_write:
        warnings.warn(
            f"render_manifests: the arguments are over the payload's limit of {MAX_PAYLOAD_BYTES} bytes, so a run "
            f"spills them under the try's artifact location, {task_context.artifact_uri}/{ARGUMENTS_FOLDER}/ "
            "([torch_elastic] artifact_storage), and its payload refers to them there. This dry run wrote nothing: "
            f"the payload shown refers to {len(would_write)} file(s) that do not exist: " + ", ".join(would_write),
            UserWarning,
            stacklevel=5,  # the caller of TorchElasticOperator.render_manifests or .plan
        )
    elif len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"render_manifests: the payload is {len(payload)} bytes, more than the payload Secret holds "
            f"({MAX_PAYLOAD_BYTES} bytes), and the try has no artifact location to spill its arguments to, so a run "
            "would fail at submit: set [torch_elastic] artifact_storage (env AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE, "
            "an fsspec URL the pods and the Airflow workers reach) to spill them there, or pass large data by "
            "reference (object storage paths) instead of as arguments or captured variables"
        )
