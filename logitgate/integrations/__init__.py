"""Integrations with inference engines: Hugging Face transformers and vLLM (v1 logits processors)."""
