"""What a task would create, rendered without a run (``TorchElasticOperator.render_manifests``), and the pieces a
run renders the same way: the try's identity, its run context and its manifests.

A try renders its manifests from these alone, so a worker that re-attaches after a crash renders the same objects.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any, Final, cast

from airflow_provider_torchelastic.core.naming import RunIdentity, placeholder_identity
from airflow_provider_torchelastic.core.run_context import TaskContext, artifact_location, checkpoint_location
from airflow_provider_torchelastic.core.validation import is_templated
from airflow_provider_torchelastic.kubernetes import kinds
from airflow_provider_torchelastic.kubernetes import render as kubernetes_render
from airflow_provider_torchelastic.operators.exceptions import ConfigurationError
from airflow_provider_torchelastic.operators.results import result_url
from airflow_provider_torchelastic.operators.spill import ARGUMENTS_FOLDER, MAX_PAYLOAD_BYTES, dump_try_payload

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context

    from airflow_provider_torchelastic.operators.operator import TorchElasticOperator
    from airflow_provider_torchelastic.settings import Settings

__all__ = ["UNRENDERED_IMAGE", "identity_of", "render_objects", "render_without_run", "task_context_of"]

#: Stands in for an image that only the run can render (``.invalid`` is a reserved domain: it is never pulled).
UNRENDERED_IMAGE: Final = "image.invalid/rendered-at-run-time:placeholder"
_UNRENDERED_NAMESPACE: Final = "default"


def identity_of(op: TorchElasticOperator, context: Context | None) -> RunIdentity:
    """The try's identity from its context; a placeholder run's outside one."""
    if context is None:
        return placeholder_identity(op.dag_id, op.task_id)
    ti = context["ti"]
    return RunIdentity(
        dag_id=ti.dag_id,
        task_id=ti.task_id,
        run_id=ti.run_id,
        map_index=ti.map_index if ti.map_index is not None else -1,
        try_number=ti.try_number,
    )


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


def render_objects(
    op: TorchElasticOperator,
    identity: RunIdentity,
    namespace: str,
    payload: bytes,
    settings: Settings,
    *,
    image: str | None = None,
    task_context: TaskContext | None = None,
    kind: kinds.JobKind | None = None,
) -> list[dict[str, Any]]:
    """The manifests of one try; ``image`` (rendered) replaces the operator's when given. Where neither the
    replicas, the operator nor the pod template names an image, ``[torch_elastic] image`` does.

    ``kind``: the one the submit chose (:func:`kinds.choose`); without it, the one ``job_kind`` fixes, else (``auto``
    with several nodes, which only the cluster decides) a PyTorchJob.
    """
    if kind is None:
        kind = kinds.choose(op.task_config, settings.job_kind)[0]
    return kubernetes_render.render_manifests(
        op.task_config,
        identity=identity,
        namespace=namespace,
        image=image if image is not None else op.image,
        payload=payload,
        pod_options=op.pod_options,
        job_options=op.job_options,
        default_image=settings.image,
        renderer=kind.render,
        task_context=task_context,
        result_url=result_url(settings.result_storage, task_context) if task_context is not None else None,
        report_interval=settings.report_interval,
        stall_timeout=op.stall_timeout,
        grace_period=op.termination_grace_period,
    )


def _placeholder_context(op: BaseOperator, identity: RunIdentity) -> dict[str, Any]:
    """A minimal template context for a task outside a run: what the placeholder identity, the DAG and the task
    know, and Variables that can be read here (environment, secrets backends). No XComs, dates or connections."""
    from airflow.sdk.execution_time.context import VariableAccessor

    ti = SimpleNamespace(**asdict(identity))  # the identity's fields, read as a task instance's
    params = op.params.dump() if hasattr(op.params, "dump") else dict(op.params or {})
    return {
        "dag": op.dag if op.has_dag() else None,
        "task": op,
        "ti": ti,
        "task_instance": ti,
        "run_id": identity.run_id,
        "params": params,
        "var": {"value": VariableAccessor(deserialize_json=False), "json": VariableAccessor(deserialize_json=True)},
    }


def _render_template_fields(
    op: BaseOperator, names: Sequence[str], context: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``names`` rendered with ``context``, without changing ``op``; and why each field that failed could not be."""
    import jinja2
    import jinja2.sandbox

    if op.has_dag():
        env = op.get_template_env()
    else:  # the SDK's DAG-less default renders an undefined name as "": here it must say so
        env = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined, cache_size=0)
    rendered: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name in names:
        value = getattr(op, name)
        if name not in op.template_fields or value is None:
            rendered[name] = value
            continue
        try:
            rendered[name] = op.render_template(value, context, env)  # type: ignore[arg-type]
        except Exception as e:  # any template error: the field is named, never fatal here
            failed[name] = f"{type(e).__name__}: {e}"
            rendered[name] = value
    return rendered, failed


def render_without_run(op: TorchElasticOperator, context: Context | None, settings: Settings) -> list[dict[str, Any]]:
    """The body of ``TorchElasticOperator.render_manifests`` (its docstring says what it promises)."""
    identity = identity_of(op, context)
    template_context = context if context is not None else _placeholder_context(op, identity)
    rendered, failed = _render_template_fields(
        op, ("image", "namespace", "op_args", "op_kwargs", "args", "checkpoint_uri"), template_context
    )
    image, namespace = rendered["image"], rendered["namespace"]
    if "image" in failed or is_templated(image):
        failed.setdefault("image", "it renders to another template")
        image = UNRENDERED_IMAGE
    if "namespace" in failed or is_templated(namespace):
        failed.setdefault("namespace", "it renders to another template")
        namespace = _UNRENDERED_NAMESPACE
    checkpoint_uri = rendered["checkpoint_uri"]
    if "checkpoint_uri" in failed or is_templated(checkpoint_uri):
        failed.setdefault("checkpoint_uri", "it renders to another template")
        checkpoint_uri = None
    if failed:
        placeholders = {
            "image": repr(UNRENDERED_IMAGE),
            "namespace": repr(_UNRENDERED_NAMESPACE),
            "checkpoint_uri": "the [torch_elastic] checkpoint_root location, or none",
        }
        warnings.warn(
            "render_manifests: these templated fields need the task's run and are shown with placeholders: "
            + "; ".join(
                f"{name} ({reason}; shown as {placeholders.get(name, 'its unrendered value, in the payload')})"
                for name, reason in failed.items()
            ),
            UserWarning,
            # The caller of TorchElasticOperator.render_manifests, two frames up from here.
            stacklevel=3,
        )
    task_context = task_context_of(identity, context, checkpoint_uri, settings)
    fn, fn_args, fn_kwargs = op.training_call(rendered)
    payload = _dry_run_payload(op, fn, fn_args, fn_kwargs, settings, task_context)
    return render_objects(
        op,
        identity,
        namespace if namespace is not None else "default",
        payload,
        settings,
        image=image,
        task_context=task_context,
    )


class _Discarded(io.RawIOBase):
    """A file that keeps nothing: what a dry run spills arguments into."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def _dry_run_payload(
    op: TorchElasticOperator,
    fn: Callable[..., Any],
    args: Collection[Any],
    kwargs: Mapping[str, Any],
    settings: Settings,
    task_context: TaskContext,
) -> bytes:
    """The payload a run would submit, without writing to storage: arguments over the payload's limit are spilled as
    a run spills them, but into nothing, so the payload names the files a run would write (their URLs, sizes and
    sha256s) and a ``UserWarning`` says they do not exist. Over the limit with no artifact location to spill to, a
    run would fail at submit: ``ValueError`` naming the option that fixes it."""
    would_write: list[str] = []

    def open_nothing(url: str) -> IO[bytes]:
        would_write.append(url)
        return cast("IO[bytes]", _Discarded())

    payload = dump_try_payload(
        fn,
        args,
        kwargs,
        storage=settings.artifact_storage,
        task_context=task_context,
        open_write=open_nothing,
        trusted_roots=op.trusted_artifact_roots,
        allow_pickles=op.allow_pickled_artifacts,
    )
    if would_write:
        warnings.warn(
            f"render_manifests: the arguments are over the payload's limit of {MAX_PAYLOAD_BYTES} bytes, so a run "
            f"spills them under the try's artifact location, {task_context.artifact_uri}/{ARGUMENTS_FOLDER}/ "
            "([torch_elastic] artifact_storage), and its payload refers to them there. This dry run wrote nothing: "
            f"the payload shown refers to {len(would_write)} file(s) that do not exist: " + ", ".join(would_write),
            UserWarning,
            stacklevel=4,  # the caller of TorchElasticOperator.render_manifests
        )
    elif len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"render_manifests: the payload is {len(payload)} bytes, more than the payload Secret holds "
            f"({MAX_PAYLOAD_BYTES} bytes), and the try has no artifact location to spill its arguments to, so a run "
            "would fail at submit: set [torch_elastic] artifact_storage (env AIRFLOW__TORCH_ELASTIC__ARTIFACT_STORAGE, "
            "an fsspec URL the pods and the Airflow workers reach) to spill them there, or pass large data by "
            "reference (object storage paths) instead of as arguments or captured variables"
        )
    return payload
