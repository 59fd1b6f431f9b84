"""``python -m pleserver``: the ``pleserver`` command, for an environment whose
scripts directory is not on ``PATH``."""

import sys

from pleserver.cli import main

if __name__ == "__main__":
    sys.exit(main())
