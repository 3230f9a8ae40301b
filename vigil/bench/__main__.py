"""``python -m vigil.bench <name> [args]``."""

import sys

from vigil.bench import main

if __name__ == "__main__":
    sys.exit(main())
