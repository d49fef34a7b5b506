"""``python -m transformdsl`` is the ``transformdsl`` command."""

import sys

try:
    from .cli import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C while the command line itself is being imported
    print("interrupted", file=sys.stderr)
    status = 130
raise SystemExit(status)
