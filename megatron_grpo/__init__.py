"""megatron-grpo: full-parameter GRPO of Qwen3-Omni MoE on Megatron-Core, rollouts from vLLM."""
__version__ = "0.1.0"
