"""``python -m v4compile.cli``: the ``v4compile`` command."""

import sys

from . import main

sys.exit(main())
