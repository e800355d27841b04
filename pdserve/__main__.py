"""`python -m pdserve ...`: the same command line as the `pdserve` script."""

import sys

from pdserve.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
