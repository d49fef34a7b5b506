"""``python -m transformdsl`` is the ``transformdsl`` command.

Python's ``-m`` puts the current directory first on ``sys.path``; a downloaded model repository the
user has ``cd``'d into could then shadow an installed module, or declare a transform through a
``*.dist-info`` there.  That entry is dropped before anything else is imported (the console script
``transformdsl`` never has it; ``PYTHONPATH`` entries are kept: an explicit choice).  What ran
before this module (the package's ``__init__``, which imports only its own modules) cannot be
undone here; ``python -P -m transformdsl`` or the console script avoid even that.
"""

import os
import sys

try:
    _HERE = os.getcwd()
except OSError:  # the current directory was removed: nothing can be imported from it
    _HERE = None
if not sys.flags.safe_path and sys.path and sys.path[0] in ("", _HERE):
    del sys.path[0]

try:
    from .cli import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C while the command line itself is being imported
    print("interrupted", file=sys.stderr)
    status = 130
raise SystemExit(status)
