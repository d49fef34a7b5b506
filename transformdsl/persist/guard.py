"""What every load runs inside: the hub offline and standard input closed to libraries.

``transformdsl.load`` calls into diffusers and transformers (building models from saved
configurations, loading untransformed pipeline components).  Inside :func:`loading`:

- the Hugging Face hub is offline for every library call, whatever the environment
  (``HF_HUB_OFFLINE``, and the copies of that setting the libraries read at import time):
  a saved configuration naming a hub repository (``"backbone": "org/name"``) cannot
  make a network request;
- standard input is an empty stream: a library that would ask a question
  ("Do you wish to run the custom code?") reads end-of-file and gives up instead of
  blocking or running code on a keystroke.

The settings are process-wide (Python has no per-thread environment); they are restored
when the last concurrent load leaves.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Iterator

_LIBRARIES = ("huggingface_hub", "diffusers", "transformers", "accelerate", "timm")
_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")

_lock = threading.Lock()
_depth = 0
_saved: dict = {}


#: The module object last looked at under each name, and those that hold a copy of the
#: setting: each load looks again only at modules imported (or re-imported) since the last one
#: (asking every library module for the attribute cost ~2 ms per load, twice: the largest fixed
#: cost of loading a small model).
_seen: dict[str, object] = {}
_holders: dict[str, object] = {}
#: (number of modules, the last imported, its id) at the last complete scan.
_fingerprint: tuple = ()


def _set_constants(value: bool) -> None:
    """Set every imported copy of ``HF_HUB_OFFLINE`` in the libraries to ``value``."""
    global _fingerprint
    modules = sys.modules
    # Unchanged since the last look: the same number of modules and the same one imported last
    # (an import, or a re-import after a deletion, appends to sys.modules).
    last = next(reversed(modules), None)
    fingerprint = (len(modules), last, id(modules.get(last)))
    # A holder replaced in place under its name leaves the fingerprint as it was: checked apart.
    if fingerprint != _fingerprint or any(modules.get(n) is not m for n, m in _holders.items()):
        _fingerprint = fingerprint if _scan() else ()
    for name, module in _holders.items():
        if modules.get(name) is module:
            module.HF_HUB_OFFLINE = value


def _scan() -> bool:
    """Look at the modules imported, or imported again, since the last scan; False if one was
    still being imported (it is looked at again next time)."""
    complete = True
    modules = dict(sys.modules)
    for name in [n for n, m in _holders.items() if modules.get(n) is not m]:
        del _holders[name]  # removed or replaced: the new module, if any, is looked at below
    for name, module in modules.items():
        if _seen.get(name) is module:
            continue
        if module is not None and name.startswith(_LIBRARIES):
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                complete = False  # still importing: it may define the setting later; looked at again
                if isinstance(getattr(module, "HF_HUB_OFFLINE", None), bool):
                    _holders[name] = module
                continue
            if isinstance(getattr(module, "HF_HUB_OFFLINE", None), bool):
                _holders[name] = module
            else:
                _holders.pop(name, None)
        _seen[name] = module
    return complete


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Run a load with the hub offline and standard input empty (see the module docstring)."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved["env"] = {key: os.environ.get(key) for key in _ENV}
            for key in _ENV:
                os.environ[key] = "1"
            _saved["stdin"] = sys.stdin
            sys.stdin = io.StringIO("")
            try:
                import huggingface_hub.constants as hub
            except ImportError:  # no hub library: nothing to set (a plain torch model)
                hub = None
            # Copies imported during the load read the environment set above; all get reset.
            _saved["offline"] = bool(hub and hub.HF_HUB_OFFLINE)
            _set_constants(True)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set_constants(_saved.pop("offline"))
                sys.stdin = _saved.pop("stdin")
                for key, value in _saved.pop("env").items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


def offline_constants() -> None:
    """Inside :func:`loading`, after importing a library: set its copies of the setting too."""
    with _lock:
        if _depth:
            _set_constants(True)
