"""What a rank tells its runner while it trains (a heartbeat), and what the runner tells it (a stop was requested).

Both are files, named in the workers' environment by the runner (:mod:`airflow_provider_torchelastic.runner.agent`):

- each rank keeps ``<TORCHELASTIC_HEARTBEAT_DIR>/rank-<RANK>`` (its pid inside, its mtime the last sign of progress),
  touched by the runner's worker wrapper when the function starts, by every optimizer step, by ``report()`` and by
  :func:`heartbeat`; the runner calls a rank silent for ``stall_timeout`` stalled. Files, not pipes or output lines,
  because ranks other than 0 usually print nothing, a stuck rank cannot be asked anything, and a file outlives the
  process that wrote it;
- the runner creates ``TORCHELASTIC_STOP_FILE`` when its pod or process gets SIGTERM (a preemption, a drain, a
  deleted pod, a killed task): :func:`stop_requested` then says True, and the training code can save a checkpoint
  and return (or raise ``RecoverableError``) within the grace period.

Standard library only, and nothing is imported while a rank trains: it runs in the workers, where there is no Airflow.
Outside a runner's workers (no such variables) :func:`heartbeat` does nothing and :func:`stop_requested` is False.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Final

__all__ = ["heartbeat", "stop_requested"]

#: The folder of the ranks' heartbeat files, set by the runner when stall detection is on.
HEARTBEAT_DIR_ENV: Final = "TORCHELASTIC_HEARTBEAT_DIR"
#: The file whose existence means "stop": set by the runner for every worker.
STOP_FILE_ENV: Final = "TORCHELASTIC_STOP_FILE"
#: A heartbeat file's name for a global rank.
HEARTBEAT_PREFIX: Final = "rank-"
#: Beside a heartbeat file: the rank's function has returned (it is done, not silent).
DONE_SUFFIX: Final = ".done"
#: At most one write a second, so that a heartbeat in a tight loop (every optimizer step) costs a clock read.
_MIN_INTERVAL: Final = 1.0

_last_beat = -_MIN_INTERVAL


def heartbeat_path(folder: str, rank: int | str) -> str:
    return os.path.join(folder, f"{HEARTBEAT_PREFIX}{rank}")


def _own_path() -> str | None:
    folder, rank = os.environ.get(HEARTBEAT_DIR_ENV), os.environ.get("RANK")
    return heartbeat_path(folder, rank) if folder and rank is not None else None


def heartbeat(*, force: bool = False) -> None:
    """Tell the runner that this rank is making progress.

    Every optimizer step and every ``report()`` already does; call it yourself in a loop that does neither for a
    long time (a long evaluation, preprocessing on rank 0 while the others wait). Cheap: at most one file write a
    second, nothing at all outside a runner's workers.
    """
    global _last_beat
    now = time.monotonic()
    if not force and now - _last_beat < _MIN_INTERVAL:
        return
    _last_beat = now
    path = _own_path()
    if path is None:
        return
    with contextlib.suppress(OSError):  # progress is advisory: a full disk must not fail the training step
        try:
            os.utime(path)
        except FileNotFoundError:
            with open(path, "w") as f:
                f.write(str(os.getpid()))


def mark_done() -> None:
    """This rank's function returned: the runner no longer waits for progress from it."""
    path = _own_path()
    if path is not None:
        with contextlib.suppress(OSError):
            open(path + DONE_SUFFIX, "w").close()


def stop_requested() -> bool:
    """Whether the runner was asked to stop (its pod is being deleted or preempted, the task is being killed).

    Check it in the training loop; when True, save a checkpoint and return, or raise ``RecoverableError``: the try
    then fails as preempted (recoverable) and the next try resumes from that checkpoint. The runner waits for the
    function up to the task's ``termination_grace_period`` (minus a few seconds for its report).
    """
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)  # type: ignore[arg-type]
