"""The built-in transforms, one family per folder (or file).

Each family's ``__init__.py`` is its torch-free *declaration*: the :class:`~transformdsl.extend.Transform`
subclasses with their verb, mode, options and rules, which ``transformdsl check`` reads.  Beside it, the
implementation (named by each declaration's ``implementation``), imported only when a model is planned,
transformed or loaded, and the family's layers, numerics and hooks into other stages.  The registry
(:data:`transformdsl.registry.BUILTIN`) is the only list of them.

:mod:`.common` holds what several families share (layers that store a weight in another dtype,
blocked upcasts, placing a module on a skeleton).
"""
