"""Helpers shared by the main suite's tests (not tests themselves, not logitgate): each module has
one job, named by its file. tests/vllm_engine keeps its own helpers next to its tests (another venv)."""
