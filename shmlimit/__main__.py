"""``python -m shmlimit``: the ``shmlimit`` command, where its script is not on PATH."""

import sys

from shmlimit.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
