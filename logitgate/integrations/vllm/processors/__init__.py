"""Tree decode as a vLLM custom logits processor, where the plugin's structured-output route is not
used: tree_decode.py (vLLM's v1 model runner), tree_decode_v2.py (Model Runner V2, and `TreeDecode`,
one name both runners load). Exported by the package (`logitgate.integrations.vllm:TreeDecode`).
"""
