"""``python -m arctic.plan``: see :mod:`arctic.plan.cli`."""

import gc
import sys

from arctic.plan import workers
from arctic.plan.cli import main

if __name__ == "__main__":  # the tracing workers (spawned) import this module too
    workers.FORK_FROM_HERE.append(True)  # its tracing processes fork from it
    status = main()
    # The interpreter's last collections would walk every object torch and transformers
    # made (over a second on 2 cores); the atexit handlers still run, only that walk stops.
    gc.freeze()
    sys.exit(status)
