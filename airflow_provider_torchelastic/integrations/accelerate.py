"""Hugging Face ``accelerate`` under a torch_elastic task.

::

    from accelerate import Accelerator
    from airflow_provider_torchelastic.integrations import accelerate as te_accelerate

    accelerator = Accelerator(log_with=te_accelerate.TorchElasticTracker())
    accelerator.init_trackers("train")                     # trackers get nothing before this
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    checkpoints = te_accelerate.Checkpoints(accelerator)   # restores the local folder, wraps save_state
    for step in range(checkpoints.resume(), steps):        # 0, or the step after the newest complete checkpoint
        ...
        accelerator.log({"loss": loss.item()}, step=step)
        if step % 50 == 49:
            checkpoints.save(step)                         # accelerator.save_state, then kept in the location
        checkpoints.stop_if_requested(step)                # a stopped try saves, then raises StopRequested

``Accelerator()`` without ``accelerate launch`` reads torch elastic's ``RANK``/``WORLD_SIZE``: nothing else is needed
to run distributed. :class:`TorchElasticTracker` sends what ``accelerator.log`` gets through ``report()``.
:class:`Checkpoints` keeps a local folder of this node (``save_state`` writes local paths only) in the task's
checkpoint location (``{checkpoint_uri}/accelerate``): ``accelerate`` has no post-save hook, so the accelerator's
``save_state`` is wrapped, and every save into the folder is published (every rank's files, a barrier, one commit
marker: :class:`~airflow_provider_torchelastic.integrations.mirror.FolderMirror`). Importing this module imports
``accelerate``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path
from typing import Any, Final

from airflow_provider_torchelastic.integrations.common import StopRequested, barrier, node_folder, numbers, stop_agreed
from airflow_provider_torchelastic.integrations.mirror import MirrorLayout
from airflow_provider_torchelastic.worker.liveness import heartbeat
from airflow_provider_torchelastic.worker.metrics import report

try:
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"airflow_provider_torchelastic.integrations.accelerate needs accelerate ({e}): pip install accelerate"
    ) from e

__all__ = ["KIND", "Checkpoints", "TorchElasticTracker"]

#: The kind of this integration's commit markers in the checkpoint location.
KIND: Final = "accelerate"
#: The sub-folder of the task's checkpoint location.
SUBFOLDER: Final = "accelerate"
_STEP = re.compile(r"step-(\d+)")
#: ``save_state``'s folders, and the one file each process writes itself (``save_accelerator_state``); every other
#: file is the main process's.
_LAYOUT: Final = MirrorLayout(KIND, SUBFOLDER, _STEP, re.compile(r"random_states_(\d+)\.pkl"))


class TorchElasticTracker(GeneralTracker):  # type: ignore[misc]
    """An ``accelerate`` tracker: ``accelerator.log(values, step=...)`` goes through ``report()`` (main process)."""

    name = "torch_elastic"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "torch_elastic") -> None:
        super().__init__()
        self.run_name = run_name

    @property
    def tracker(self) -> TorchElasticTracker:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """A run's configuration is not a metric: nothing is sent."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        heartbeat()
        found = numbers(values)
        if found:
            report(step=step, **found)


class Checkpoints:
    """The accelerator's ``save_state`` checkpoints, kept in the task's checkpoint location.

    Made once the accelerator is (every rank): restores the local folder from the location, and wraps
    ``accelerator.save_state`` so that each save into the folder is published there. :meth:`resume` loads the newest,
    :meth:`save` saves a step, :meth:`stop_if_requested` saves and stops a try that is being stopped.

    :param folder: the local folder (per node); by default one under the system's temporary folder.
    :param location: where the checkpoints go; by default ``{context.current().checkpoint_uri}/accelerate``.
    :param keep: how many of the newest checkpoints to keep, locally and in the location (None: all).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        folder: str | os.PathLike[str] | None = None,
        location: str | None = None,
        keep: int | None = 2,
    ) -> None:
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"keep: expected an int >= 1 or None, got {keep!r}")
        self.accelerator = accelerator
        self.folder = Path(folder if folder is not None else node_folder(SUBFOLDER))
        self.keep = keep
        self.mirror = _LAYOUT.mirror(self.folder, location)
        self.mirror.restore()
        original = accelerator.save_state

        @functools.wraps(original)
        def save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            saved = original(output_dir, *args, **kwargs)
            self._publish(Path(str(saved)))
            return saved

        accelerator.save_state = save_state  # accelerate has no post-save hook: the one save_state of this accelerator

    def path(self, step: int) -> str:
        """The local folder of ``step``'s checkpoint."""
        return str(self.folder / f"step-{step}")

    def newest(self) -> int | None:
        """The step of the newest checkpoint in the local folder (after the restore: the location's), or None."""
        steps = [int(m.group(1)) for p in self._entries() if (m := _STEP.fullmatch(p.name))]
        return max(steps, default=None)

    def resume(self) -> int:
        """Loads the newest complete checkpoint into the accelerator (``load_state``) and returns the step to start
        from: the one after it, or 0 when there is none."""
        step = self.newest()
        if step is None:
            return 0
        self.accelerator.load_state(self.path(step))
        return step + 1

    def save(self, step: int) -> None:
        """``accelerator.save_state`` of ``step`` (every rank), then kept in the location."""
        self.accelerator.save_state(self.path(step))

    def stop_if_requested(self, step: int) -> None:
        """Every rank calls it at the same point of each step: when the try is being stopped, all of them save
        ``step`` and raise :class:`~airflow_provider_torchelastic.integrations.common.StopRequested` (recoverable).
        """
        heartbeat()
        if stop_agreed():
            self.save(step)
            raise StopRequested(f"the try was asked to stop: saved step {step}")

    def _entries(self) -> list[Path]:
        return sorted(self.folder.iterdir()) if self.folder.is_dir() else []

    def _publish(self, saved: Path) -> None:
        match = _STEP.fullmatch(saved.name)
        if match is None or Path(os.path.abspath(saved.parent)) != self.mirror.local:
            return  # saved elsewhere: not one of this folder's checkpoints
        step = int(match.group(1))
        if self.keep is not None:
            barrier()  # every rank of this node wrote into the new folder
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                older = sorted((p for p in self._entries() if _STEP.fullmatch(p.name)), key=_step_of)
                for stale in older[: -self.keep]:
                    shutil.rmtree(stale, ignore_errors=True)
        # Deleted locally above, so the mirror deletes them in the location once this one is committed.
        self.mirror.publish(saved.name, step=step)


def _step_of(path: Path) -> int:
    match = _STEP.fullmatch(path.name)
    return int(match.group(1)) if match else -1
