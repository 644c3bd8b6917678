"""``python -m airflow_provider_torchelastic.runner``: see the package docstring for options and exit codes."""

from airflow_provider_torchelastic.runner.agent import main

raise SystemExit(main())
