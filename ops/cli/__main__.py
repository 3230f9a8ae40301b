"""``python -m ops.cli``: the ``vigil`` command."""

import sys

from ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
