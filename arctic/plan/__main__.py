"""``python -m arctic.plan``: see :mod:`arctic.plan.cli`."""

import sys

from arctic.plan.cli import main

if __name__ == "__main__":  # the tracing workers (spawned) import this module too
    sys.exit(main())
