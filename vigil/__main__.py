"""``python -m vigil``: the Ray job entrypoint (see :mod:`vigil.driver`)."""

import sys

from vigil.driver import main

if __name__ == "__main__":
    sys.exit(main())
