"""inferlab beside its peers: the command line of the package benchmarks/side_by_side/ (see its
__init__.py for what it measures and how).

    .venv/bin/python benchmarks/side_by_side.py --help
"""

import sys

from side_by_side.cli import main  # the package benchmarks/side_by_side/, found before this file

if __name__ == "__main__":
    sys.exit(main())
