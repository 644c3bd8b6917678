"""The public path of ``PodOptions``, ``JobOptions``, ``secret_key_ref`` and ``config_map_key_ref``.

The module itself is :mod:`airflow_provider_torchelastic.core.pod_options`.
Not a copy: importing this path gives that very module (one module object, so its state and ``mock.patch`` have
one place), and DAG files, training code and pickled references written against this path keep working.
"""

import sys

from airflow_provider_torchelastic.core.pod_options import *  # noqa: F403 (what type checkers and readers see)
from airflow_provider_torchelastic.core.pod_options import __all__ as __all__

sys.modules[__name__] = sys.modules["airflow_provider_torchelastic.core.pod_options"]
