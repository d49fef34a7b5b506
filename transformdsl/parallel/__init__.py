"""Past one device: a loaded model sharded tensor-parallel over ``torch.distributed`` (spec.md "Past one device").

One module per stage, each importing only those above it:

- :mod:`.shards`: one layer's local shard (rows or columns of its stored tensors, with their scales,
  zeros and bias), for every layer kind that shards; no process group;
- :mod:`.layout`: the model's tensor-parallel plan (transformers' ``tp_plan`` styles) resolved into one
  :class:`~.layout.Placement` per layer, or the refusals naming each layer that cannot be sharded and
  what would work; no process group (``describe(model, world_size)`` runs in one process);
- :mod:`.runtime`: the process group (gloo on CPUs, NCCL on GPUs), the collectives around each sharded
  layer's forward, and :func:`~.runtime.load_tensor_parallel`, which ``transformdsl.load(dir,
  tp_plan=...)`` calls; a failure in any rank ends every rank with the same :class:`LoadError`.
"""

from __future__ import annotations
