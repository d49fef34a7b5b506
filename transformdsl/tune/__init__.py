"""``transformdsl.tune``: find the script that meets a quality budget on this machine, and say why.

``transformdsl.tune(model, max_kl=0.05, goal="size")`` returns a :class:`TuneResult` (the script with
its measured figures as comments, the whole scripts measured, the Pareto table, a plot); ``check``
re-measures a tuned script against its budget.  The search is in :mod:`.api` (spec.md "Finding a
script: tune"); optuna is imported when a tune starts, matplotlib when a plot is written.

``transformdsl.tune`` is this package, callable as :func:`tune` (same signature; ``help()`` shows
the function's docstring below), so that ``transformdsl.tune(model, ...)`` and
``transformdsl.tune.check(...)`` both work, whichever was imported first.
"""

from __future__ import annotations

import inspect
import sys
import types

from .api import CheckResult, TuneResult, certificate, check, tune

__all__ = ["tune", "check", "certificate", "TuneResult", "CheckResult"]


class CallablePackage(types.ModuleType):
    """This package, callable as :func:`tune`."""

    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = CallablePackage
__signature__ = inspect.signature(tune)
__doc__ = f"{__doc__}\n``tune(model, ...)``: {tune.__doc__}"
