"""Embedded models for the demo and tests: a byte-level tokenizer (also as a Hugging Face tokenizer)
and a target / draft pair; and, built in code and cached, the json_writer model for the served
benchmark (a tiny Llama with the Llama-3 tokenizer that writes its schemas' records)."""
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
from .json_records import BOUNDED_SCHEMA, UNBOUNDED_SCHEMA
from .json_writer import json_writer_model
from .random_prompts import random_prompt_texts, random_prompts

__all__ = [
    "BOS_ID",
    "BOUNDED_SCHEMA",
    "CATALOG_PATH",
    "DEMO_DIR",
    "DRAFT_DIR",
    "EOS_ID",
    "PAD_ID",
    "ROOT_ID",
    "SPECIAL_TOKENS",
    "TARGET_DIR",
    "TREE_PATH",
    "UNBOUNDED_SCHEMA",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "build_prefix_dict",
    "catalog_prefix_dict",
    "demo_hf_tokenizer",
    "demo_prompt",
    "demo_tokenizer",
    "json_writer_model",
    "load_catalog",
    "load_demo_model",
    "load_demo_models",
    "load_tree_config",
    "random_prompt_texts",
    "random_prompts",
]
