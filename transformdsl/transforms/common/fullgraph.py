"""The rule between a step cache and ``compile fullgraph=true``, declared once (spec.md "cache", rule table).

A cache mode declares whether it breaks a full graph (``Cache.breaks_fullgraph``, measured: its per-step
decision runs in functions torch.compile may not trace).  The rule is checked in three places, one message:
the cache family against a ``compile`` statement of the same script and against a model compiled by an
earlier script, the compile family against a model that already runs a step cache.  Torch-free.
"""

from __future__ import annotations

from ... import registry


def refusal(cache: str, compiled: str, fix: str) -> str:
    """The one message of the rule: ``cache`` (what runs the step cache) ``decides at run time...``, so
    ``compiled`` (what is compiled with fullgraph=true) fails at the first call; ``fix``: what to write."""
    return (f"{cache} decides at run time what a step skips, in functions torch.compile may not trace "
            f"(torch.compiler.disable: the per-step decision), so {compiled} fails at the first call (measured); "
            f"write {fix}")


def breaks_fullgraph(config_class: str) -> bool:
    """Whether a step cache enabled with diffusers' ``config_class`` (e.g. ``"FirstBlockCacheConfig"``, one
    enabled by hand, outside any script) breaks a full graph: what the cache mode declaring that config
    says; a config no mode declares is taken to break it."""
    for key in registry.keys():
        if key.startswith("cache "):
            declared = registry.declaration(key)
            if getattr(declared, "config_class", None) == config_class:
                return bool(getattr(declared, "breaks_fullgraph", True))
    return True
