"""``python -m agent``: the same as ``vigil agent``."""

import sys

from agent.main import main

sys.exit(main())
