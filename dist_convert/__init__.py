"""dist_convert: a distributed, torchrun-launched converter for Megatron-Core LLM checkpoints."""
__version__ = "0.1.0"
