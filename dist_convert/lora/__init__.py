"""LoRA adapters: one logical model of an adapter (``adapter.py``), how one adapter's structure is laid into
another's (``structure.py``: HF peft's per-projection adapters, Megatron-Bridge's fused ones), and the merge
into a base as each rank writes its own slices of it (``merge.py``)."""
