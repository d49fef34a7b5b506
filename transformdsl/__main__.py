"""``python -m transformdsl`` is the ``transformdsl`` command."""

from .cli import main

raise SystemExit(main())
