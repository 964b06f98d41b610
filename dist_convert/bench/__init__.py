"""``dist_convert bench``: a synthetic Llama-shaped checkpoint, then, in the same run, the I/O floor,
dist_convert at several world sizes, the whole-model single-process baseline and megatron-core's own
``dist_checkpointing`` load + save, as a table (and JSON / PNG) with the targets of the performance issue;
from a Hugging Face source (``--format hf`` or ``--src HF_DIR``), Megatron-Bridge's own HF import against
dist_convert's (``--methods bridge,dist_convert``).

Modules: ``shape`` (pure: a Llama shape of a given size), ``synth`` (seeded values, the synthetic
writer, launched under torchrun), ``baselines`` (the whole-model single-process converter), ``mcore_job``
(megatron-core load + save under torchrun), ``bridge_job`` (Megatron-Bridge's HF import, run by path in
the interpreter that has Bridge), ``bridge`` (that job's command, the check that its output equals
dist_convert's, the ratios), ``measure`` (subprocesses, timing), ``report`` (pure check math, the tables,
JSON and plot), ``run`` (per target layout, every method), ``scaling`` (``--sizes``), ``main`` (the ``bench``
subcommand: checks the options, runs ``run``, ``scaling`` or ``plan_scale``, reports).
"""
