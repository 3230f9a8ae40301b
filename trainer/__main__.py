"""Compatibility: ``python -m trainer`` is ``python -m vigil`` (the job driver)."""

import sys

from vigil.driver import main

if __name__ == "__main__":
    sys.exit(main())
