"""Helpers shared by the main suite's tests (not tests themselves, not logitgate): each module has
one job, named by its file. The engine tests' helpers (tests/vllm_engine, run in .venv-vllm) are here
too: server_helpers, json_engine, engine_scenarios, tree_reference, tree_route_requests, vllm_runtime."""
