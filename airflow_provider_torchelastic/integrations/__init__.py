"""Hugging Face ``transformers``, Lightning and ``accelerate`` under a torch_elastic task: their metrics in the job
summary and the Airflow UI, their checkpoints in the task's checkpoint location (so a retry resumes), a graceful stop
when the try is stopped, and the job's size where they need it.

One module per framework, each importing its framework when it is itself imported (never this package, never a DAG
file's parse)::

    from airflow_provider_torchelastic.integrations import transformers as te_transformers
    from airflow_provider_torchelastic.integrations import lightning as te_lightning
    from airflow_provider_torchelastic.integrations import accelerate as te_accelerate

What they share is :mod:`.common` (the job's size, the agreed stop, the metrics filter) and :mod:`.mirror` (a local
folder kept in the checkpoint location, for the frameworks that write local paths only). The user docs are
docs/guides/integrations.md. Nothing here imports Airflow or a Kubernetes client: it runs in the workers.
"""

from __future__ import annotations

__all__: list[str] = []
