"""``dist_convert bench``: a synthetic Llama-shaped checkpoint, then, in the same run, the I/O floor,
dist_convert at several world sizes, the whole-model single-process baseline and megatron-core's own
``dist_checkpointing`` load + save, as a table (and JSON / PNG) with the targets of the performance issue.

Modules: ``shape`` (pure: a Llama shape of a given size), ``synth`` (seeded values, the synthetic
writer, launched under torchrun), ``baselines`` (the whole-model single-process converter), ``mcore_job``
(megatron-core load + save under torchrun), ``measure`` (subprocesses, timing), ``report`` (pure check
math, the table, JSON and plot), ``run`` (the ``bench`` subcommand).
"""
