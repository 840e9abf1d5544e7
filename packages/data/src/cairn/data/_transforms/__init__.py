"""The transformations of ``cairn.data``, one module per step (Grain's layout).

``MapDataset`` / ``IterDataset`` (in ``cairn.data._dataset``) build these classes from
their method sugar; each module holds a step's ``MapDataset`` form, its ``IterDataset``
form and the iterator behind it, where the step has them:

- ``source``: sources and ``range`` (the leaves); ``seed``; ``shuffle``; ``slice``
  (also ``shard`` and ``shard_global_batches``' row blocks); ``map`` (also
  ``map_with_index`` and ``random_map``); ``filter``; ``batch``; ``repeat``;
  ``concatenate``; ``mix``; ``interleave``; ``prefetch`` (a background thread);
  ``to_iter`` (``MapDataset.to_iter_dataset()``: chunked reads, threads).
- ``common``: the one-input and many-input bases they share.

Worker processes (``mp_prefetch``) live in ``cairn.data._multiprocessing``.
"""
