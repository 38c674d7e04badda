"""internlm_offload: a config-driven LLM trainer with CPU activation and optimizer-state offload."""

__version__ = "0.1.0"
