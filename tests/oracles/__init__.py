"""The oracles: programs built on code nobody here wrote (megatron-core, Megatron-Bridge, NeMo, ModelOpt, peft,
transformers) that make checkpoints and judge dist_convert's. Each runs as a program of its own
(``torchrun tests/oracles/mcore.py ...``) or in the test session's workers (``conftest.oracle``); what they share is in
``common`` and ``te_cpu``."""
