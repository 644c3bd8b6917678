"""The ``torch_elastic`` Airflow plugin: a "Training jobs" page in the navigation and a "Training job" tab on task
instances, with the JSON API they read, mounted at ``/torch-elastic`` in the api-server.

Registered through the ``airflow.plugins`` entry point (provider-info plugins are skipped while ``[core]
lazy_discover_providers`` is on, the default). Every Airflow process loads plugins, so this module stays light: it
builds the FastAPI app, and the kubernetes client, the ORM and Airflow's auth code are imported on first request.
"""

from __future__ import annotations

from typing import Any, Final

from airflow.plugins_manager import AirflowPlugin

from airflow_provider_torchelastic.plugin.app import create_app

__all__ = ["PREFIX", "TorchElasticPlugin"]

PREFIX: Final = "/torch-elastic"
BUNDLE_URL: Final = f"{PREFIX}/static/torch-elastic.js"
ICON_URL: Final = f"{PREFIX}/static/icon.svg"


class TorchElasticPlugin(AirflowPlugin):
    name = "torch_elastic"
    # Class attributes, as AirflowPlugin declares them (the plugins manager reads them off the class).
    fastapi_apps: list[Any] = [  # noqa: RUF012
        {"app": create_app(), "url_prefix": PREFIX, "name": "Torch Elastic training jobs"}
    ]
    # One bundle defines both components, under these names (the UI looks a component up by its app's name first).
    react_apps: list[Any] = [  # noqa: RUF012
        {
            "name": "Training jobs",
            "bundle_url": BUNDLE_URL,
            "destination": "nav",
            "url_route": "training-jobs",
            "nav_top_level": True,
            "icon": ICON_URL,
        },
        {
            "name": "Training job",
            "bundle_url": BUNDLE_URL,
            "destination": "task_instance",
            "url_route": "training-job",
        },
    ]
