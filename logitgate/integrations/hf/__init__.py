"""Hugging Face transformers: logits processors for `model.generate` (processors.py: trees,
grammars, and the generation kwargs that stop at a tree's end) and `speculative_generate`
(speculative.py). Users import them from `logitgate.integrations.transformers`."""
