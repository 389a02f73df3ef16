"""Embedded models for the demo and tests: a byte-level tokenizer (also as a Hugging Face tokenizer)
and a target / draft pair."""
from .byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, ROOT_ID, SPECIAL_TOKENS, VOCAB_SIZE, ByteTokenizer
from .demo import (
    CATALOG_PATH,
    DEMO_DIR,
    DRAFT_DIR,
    TARGET_DIR,
    TREE_PATH,
    build_prefix_dict,
    catalog_prefix_dict,
    demo_hf_tokenizer,
    demo_prompt,
    demo_tokenizer,
    load_catalog,
    load_demo_model,
    load_demo_models,
    load_tree_config,
)

__all__ = [
    "BOS_ID",
    "CATALOG_PATH",
    "DEMO_DIR",
    "DRAFT_DIR",
    "EOS_ID",
    "PAD_ID",
    "ROOT_ID",
    "SPECIAL_TOKENS",
    "TARGET_DIR",
    "TREE_PATH",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "build_prefix_dict",
    "catalog_prefix_dict",
    "demo_hf_tokenizer",
    "demo_prompt",
    "demo_tokenizer",
    "load_catalog",
    "load_demo_model",
    "load_demo_models",
    "load_tree_config",
]
