"""``python -m arctic.plan``: see :mod:`arctic.plan.cli`."""

import sys

from arctic.plan.cli import main

sys.exit(main())
