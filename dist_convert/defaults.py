"""Defaults the command line and the engine share; imports nothing (the CLI parses with them before torch)."""
DEFAULT_BUDGET = 256 << 20  # bytes in flight per rank per exchange wave (--memory-budget)
MODEL_CLASSES = ("gpt", "hybrid")  # --target-model: megatron-core GPTModel or HybridModel (model_class.py)
