"""The Hugging Face ``transformers.Trainer`` under a torch_elastic task.

::

    from transformers import Trainer, TrainingArguments
    from airflow_provider_torchelastic.integrations import transformers as te_transformers

    args = TrainingArguments(output_dir=te_transformers.output_dir(), save_steps=50, use_cpu=True, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    te_transformers.train(trainer)          # in place of trainer.train()

:func:`train` adds :class:`TorchElasticCallback` when the trainer has none, restores ``output_dir`` from the task's
checkpoint location (``{checkpoint_uri}/transformers``) and resumes from its newest complete checkpoint. The callback

- sends what the Trainer logs (loss, learning rate, grad norm, epoch, eval metrics) through ``report()`` at the
  Trainer's global step, so the job summary and the UI chart them, and keeps every rank's stall heartbeat alive;
- copies each checkpoint the Trainer saves (``checkpoint-<step>/``: rank 0's files, each rank's ``rng_state_<rank>.
  pth``) to the checkpoint location, complete or not at all, and deletes there what ``save_total_limit`` rotated out
  (:class:`~airflow_provider_torchelastic.integrations.mirror.FolderMirror`);
- stops gracefully when the try is being stopped: all ranks agree at a step, the Trainer saves, the save is
  published, and :class:`~airflow_provider_torchelastic.integrations.common.StopRequested` (recoverable) ends the try.

An exception the Trainer or a callback raises keeps its class and message; ``RecoverableError`` stays recoverable.
Importing this module imports ``transformers`` (``pip install 'airflow-provider-torchelastic[frameworks]'``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

from airflow_provider_torchelastic.integrations.common import StopRequested, node_folder, numbers, stop_agreed
from airflow_provider_torchelastic.integrations.mirror import FolderMirror, MirrorLayout
from airflow_provider_torchelastic.worker.liveness import heartbeat
from airflow_provider_torchelastic.worker.metrics import report

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"airflow_provider_torchelastic.integrations.transformers needs transformers ({e}): pip install transformers"
    ) from e

__all__ = ["KIND", "TorchElasticCallback", "output_dir", "train"]

#: The kind of this integration's commit markers in the checkpoint location.
KIND: Final = "transformers.Trainer"
#: The sub-folder of the task's checkpoint location.
SUBFOLDER: Final = "transformers"
#: The Trainer's checkpoint folders, and the one file each rank writes itself (``Trainer._save_rng_state``); every
#: other file is rank 0's.
_LAYOUT: Final = MirrorLayout(KIND, SUBFOLDER, re.compile(r"checkpoint-(\d+)"), re.compile(r"rng_state_(\d+)\.pth"))


def output_dir() -> str:
    """A local folder of this node for ``TrainingArguments(output_dir=...)``: the Trainer writes local paths only, and
    :func:`train` keeps this folder in the checkpoint location."""
    return node_folder(SUBFOLDER)


class TorchElasticCallback(TrainerCallback):
    """Metrics, checkpoints kept in the task's checkpoint location, and a graceful stop, for a ``Trainer``.

    :param location: where the checkpoints go; by default ``{context.current().checkpoint_uri}/transformers`` (None
        there: they stay local, with a warning).
    """

    def __init__(self, *, location: str | None = None) -> None:
        self._location = location
        self._mirror: FolderMirror | None = None
        self._stopping = False

    def mirror_for(self, args: TrainingArguments) -> FolderMirror:
        """The mirror of ``args.output_dir`` (made once)."""
        if self._mirror is None:
            self._mirror = _LAYOUT.mirror(_folder(args), self._location)
        return self._mirror

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        heartbeat()
        values = numbers(logs or {})
        if values and state.is_world_process_zero:
            report(step=state.global_step, **values)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        heartbeat()
        if stop_agreed():  # every rank calls it at every step: they stop at the same one
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        heartbeat()  # a long evaluation is progress too

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        name = f"checkpoint-{state.global_step}"
        if os.path.isdir(os.path.join(_folder(args), name)):
            self.mirror_for(args).publish(name, step=state.global_step)
        if self._stopping:
            raise StopRequested(f"the try was asked to stop: saved {name} and stopped the Trainer")


def _folder(args: TrainingArguments) -> str:
    if not args.output_dir:
        raise ValueError(
            "TrainingArguments.output_dir: expected a local folder, got None (te_transformers.output_dir())"
        )
    return str(args.output_dir)


def train(trainer: Trainer, **kwargs: Any) -> Any:
    """``trainer.train(**kwargs)``, resumed from the newest complete checkpoint of the task's checkpoint location.

    Adds :class:`TorchElasticCallback` when the trainer has none; restores ``args.output_dir`` from the location
    (every rank, one copier per node); then passes ``resume_from_checkpoint`` (unless given) as the newest local
    ``checkpoint-<step>``, or None on a first try. Returns what ``trainer.train`` returns.
    """
    callbacks = trainer.callback_handler.callbacks
    callback = next((c for c in callbacks if isinstance(c, TorchElasticCallback)), None)
    if callback is None:
        callback = TorchElasticCallback()
        trainer.add_callback(callback)
    callback.mirror_for(trainer.args).restore()
    if "resume_from_checkpoint" not in kwargs:
        folder = _folder(trainer.args)
        last: str | None = get_last_checkpoint(folder) if os.path.isdir(folder) else None  # type: ignore[no-untyped-call]
        kwargs["resume_from_checkpoint"] = last
    return trainer.train(**kwargs)
