"""`mgrpo sft`: supervised fine-tuning (an agentic cold start) on the GRPO engine: rows with
assistant and tool turns (`rows`), their token ids and assistant-only loss mask from the chat
template (`tokens`), and the training loop (`loop`)."""
