"""``python -m airflow_provider_torchelastic.runner``: see the package docstring for options and exit codes."""

import atexit
import os
import sys
import threading

from airflow_provider_torchelastic.runner.agent import main

code = main()
if any(not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
    raise SystemExit(code)  # a thread that must finish first: the interpreter's own exit joins it
# Everything is written and reported by now; what is left of a normal exit is tearing down the modules of torch,
# about 0.5 s on a quiet machine and more on a busy one, after the workers ended and before the pod (the container's
# end) or local execution (the node's end) can see it. torchrun pays it; the runner need not. The atexit handlers
# (logging's flush among them) still run.
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    stream.flush()
os._exit(code)
