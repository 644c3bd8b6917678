"""Lightning (``lightning.pytorch``) under a torch_elastic task.

::

    import lightning.pytorch as pl
    from airflow_provider_torchelastic.integrations import lightning as te_lightning

    trainer = pl.Trainer(max_epochs=10, **te_lightning.trainer_kwargs())
    trainer.fit(model, data, ckpt_path=te_lightning.ckpt_path())

:func:`trainer_kwargs` gives the ``Trainer``

- ``num_nodes`` and ``devices`` of the running job (:func:`~airflow_provider_torchelastic.integrations.common.
  job_size`): Lightning requires ``num_nodes * devices == WORLD_SIZE``, so a hard-coded ``num_nodes`` fails an elastic
  ``min:max`` job that starts with fewer nodes;
- ``default_root_dir`` and a ``ModelCheckpoint(dirpath=..., save_last=True)`` in the task's checkpoint location
  (``{checkpoint_uri}/lightning``; Lightning writes fsspec URLs itself);
- :class:`TorchElasticLogger`, which sends what the module logs through ``report()`` (rank 0), and
  :class:`TorchElasticCallback`: the stall heartbeat on every rank, and a graceful stop.

:func:`ckpt_path` is ``last.ckpt`` of that location when there is one (the next try resumes from it), else None.
Lightning's own SIGTERM handler raises ``SIGTERMException``, a ``SystemExit`` that would fail the task for good: the
callback replaces it with a stop request, and turns a ``SIGTERMException`` that still escapes into
:class:`~airflow_provider_torchelastic.integrations.common.StopRequested` (recoverable). Any other exception keeps its
class and message (a ``MisconfigurationException`` fails the task without a retry; ``RecoverableError`` raised in a
callback or the module is retried). Importing this module imports ``lightning``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from airflow_provider_torchelastic.core.safe_files import local_path
from airflow_provider_torchelastic.integrations.common import (
    StopRequested,
    checkpoint_location,
    job_size,
    numbers,
    stop_agreed,
    watch_sigterm,
)
from airflow_provider_torchelastic.worker.liveness import heartbeat
from airflow_provider_torchelastic.worker.metrics import report

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.utilities import rank_zero_only
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"airflow_provider_torchelastic.integrations.lightning needs lightning ({e}): pip install lightning"
    ) from e

__all__ = ["TorchElasticCallback", "TorchElasticLogger", "checkpoint_dir", "ckpt_path", "trainer_kwargs"]

#: The sub-folder of the task's checkpoint location.
SUBFOLDER: Final = "lightning"


def checkpoint_dir() -> str | None:
    """``{context.current().checkpoint_uri}/lightning``, or None when the task has no checkpoint location."""
    return _for_lightning(checkpoint_location(SUBFOLDER))


def _for_lightning(location: str | None) -> str | None:
    """A ``file://`` URL as a plain path: Lightning's ModelCheckpoint takes any local-protocol ``dirpath`` for a path
    and resolves ``file:///mnt/x`` to ``<cwd>/file:/mnt/x``."""
    if location is None:
        return None
    path = local_path(location)
    return str(path) if path is not None else location


def _last_path(folder: str) -> str:
    return f"{folder.rstrip('/')}/{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


def ckpt_path(folder: str | None = None) -> str | None:
    """The ``ckpt_path`` for ``trainer.fit``: ``last.ckpt`` in ``folder`` (by default :func:`checkpoint_dir`) when it
    exists; by default, else the one of the run that ``resume_from=`` names; else None (a first try starts from
    scratch, without Lightning's warning about a missing "last").

    The full URL, rather than ``"last"``: Lightning finds "last" by listing the folder, which loses the scheme of
    an object store's URLs."""
    own = folder is None
    folder = folder if folder is not None else checkpoint_dir()
    if folder is None:
        return None
    path = _last_path(folder)
    if _modified(path) is not None:
        return path
    if not own:
        return None
    # This task's location has none: the run that resume_from= names may (read, never written).
    from airflow_provider_torchelastic.worker.checkpoint import resume_location

    other = resume_location(lambda location: _modified(_last_path(f"{_for_lightning(location)}/{SUBFOLDER}")))
    return _last_path(f"{_for_lightning(other)}/{SUBFOLDER}") if other is not None else None


def _modified(path: str) -> float | None:
    """When ``path`` was last written (a timestamp), or None when it does not exist."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    fs = get_filesystem(path)
    if not fs.exists(path):
        return None
    try:
        modified = fs.modified(path)
    except (NotImplementedError, OSError):  # a store that keeps no time: it exists, that is all we know
        return 0.0
    return float(modified.timestamp()) if hasattr(modified, "timestamp") else 0.0


def trainer_kwargs(**checkpoint_kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``lightning.pytorch.Trainer``: ``num_nodes``, ``devices``, ``default_root_dir``,
    ``callbacks`` (a ``ModelCheckpoint`` with ``save_last=True`` in the checkpoint location, then
    :class:`TorchElasticCallback`) and ``logger`` (:class:`TorchElasticLogger`). ``checkpoint_kwargs`` go to the
    ``ModelCheckpoint`` (``every_n_train_steps=50``, ``save_top_k``, ``monitor`` ...). To add callbacks of your own,
    extend the list: ``kwargs["callbacks"].append(...)``."""
    size = job_size()
    folder = checkpoint_dir()
    checkpoint = ModelCheckpoint(dirpath=folder, **{"save_last": True, **checkpoint_kwargs})
    return {
        "num_nodes": size.nodes,
        "devices": size.procs_per_node,
        "default_root_dir": folder,
        "callbacks": [checkpoint, TorchElasticCallback()],
        "logger": TorchElasticLogger(),
    }


class TorchElasticLogger(Logger):
    """A Lightning logger whose metrics go through ``report()`` at the trainer's global step (rank 0 only)."""

    @property
    def name(self) -> str:
        return "torch_elastic"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values = numbers(metrics)
        if values:
            report(step=step, **values)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are not metrics: nothing is sent."""


class TorchElasticCallback(Callback):
    """The stall heartbeat on every rank, and a graceful stop: when the try is being stopped (the runner's stop file,
    or a SIGTERM to this worker), all ranks agree at a batch, ``last.ckpt`` is saved and
    :class:`~airflow_provider_torchelastic.integrations.common.StopRequested` ends the try (recoverable)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning installed its SIGTERM handler (Trainer._run registers it just before the loops start).
        watch_sigterm()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        heartbeat()
        if stop_agreed():
            saved = self._save_last(trainer)
            where = f"saved {saved}" if saved else "no ModelCheckpoint(save_last=True) to save to"
            raise StopRequested(f"the try was asked to stop at step {trainer.global_step}: {where}")

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        heartbeat()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            raise StopRequested("Lightning stopped on SIGTERM: the try was asked to stop") from exception

    @staticmethod
    def _save_last(trainer: pl.Trainer) -> str | None:
        """``last.ckpt`` of the first ``ModelCheckpoint(save_last=...)``, saved by every rank together."""
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                path = _last_path(str(callback.dirpath))
                trainer.save_checkpoint(path)
                return path
        return None
