"""``python -m trainer.bench <name> [args]``."""

import sys

from trainer.bench import main

if __name__ == "__main__":
    sys.exit(main())
