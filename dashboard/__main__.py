"""``python -m dashboard --controller URL --port 8050``: the dashboard on its own."""

import sys

from dashboard.app import main

sys.exit(main())
