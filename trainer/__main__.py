"""``python -m trainer``: the Ray job entrypoint (see :mod:`trainer.driver`)."""

import sys

from trainer.driver import main

if __name__ == "__main__":
    sys.exit(main())
