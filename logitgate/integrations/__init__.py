"""Integrations with the engines users run: Hugging Face transformers (hf/: logits processors for
`generate`, `speculative_generate`; imported as `logitgate.integrations.transformers`), vLLM (vllm/:
the general plugin that serves trees through vLLM's structured outputs and routes its
logits-to-token work to logitgate, plus TreeDecode logits processors) and llama.cpp
(llama_cpp/: constraints, processors, skip-ahead and drafts for llama-cpp-python)."""
