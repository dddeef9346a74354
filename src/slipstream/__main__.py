"""``python -m slipstream``: the ``slipstream`` command."""

import sys

from .cli import main

sys.exit(main())
