"""The embedded default for `logitgate demo`: a byte-level target / draft causal-LM pair trained on
the IANA time-zone names (scripts/train_demo_models.py), the catalog and its tree.

Files (package data, under `logitgate/data/demo/`): `target/` and `draft/` (Hugging Face
`LlamaForCausalLM` directories, safetensors), `catalog.txt` (one name a line) and `tree.json`
(the catalog's prefix dict in RTP-LLM's format, rooted at the tree-root token).

A prompt is `<bos> hint <root>`: the hint is optional free text (a region such as "Europe" or a
city such as "Berlin"), and the tree constraint starts at `<root>`. The model then writes the
bytes of a name and `<eos>`."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .byte_tokenizer import BOS_ID, EOS_ID, ROOT_ID, ByteTokenizer

if TYPE_CHECKING:  # transformers is the optional `hf` extra: imported only by the loaders
    import torch
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"
TARGET_DIR = DEMO_DIR / "target"
DRAFT_DIR = DEMO_DIR / "draft"
CATALOG_PATH = DEMO_DIR / "catalog.txt"
TREE_PATH = DEMO_DIR / "tree.json"

_TOKENIZER = ByteTokenizer()


def demo_tokenizer() -> ByteTokenizer:
    """The tokenizer of both demo models."""
    return _TOKENIZER


def demo_hf_tokenizer() -> Any:
    """The same tokenizer as a Hugging Face tokenizer, loaded offline from the target's directory
    (identical ids; see `hf_byte_tokenizer`): what `AutoTokenizer`, xgrammar and engines use."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET_DIR, local_files_only=True)


def demo_prompt(hint: str = "") -> list[int]:
    """Prompt token ids `<bos> hint <root>`; generation after it is a catalog name then `<eos>`."""
    return [BOS_ID, *_TOKENIZER.encode(hint), ROOT_ID]


def load_catalog(path: str | Path = CATALOG_PATH) -> list[str]:
    """The catalog's names, in file order: one a line, blank lines ignored. A line ends at "\n" or
    "\r\n" only (every other character, U+2028 or a lone "\r" included, is part of its name, where
    `str.splitlines` would break), and a UTF-8 byte-order mark (Notepad, PowerShell) is not part of
    the first name."""
    with open(path, encoding="utf-8-sig", newline="") as f:  # newline="": no line-ending translation
        text = f.read()
    lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
    return [line for line in lines if line.strip()]


def build_prefix_dict(
    sequences: Iterable[Sequence[int]], *, start_token_id: int, end_token_id: int, sep: str = "_"
) -> dict[str, Any]:
    """The RTP-LLM prefix-dict config whose tree accepts exactly `sequences` (each followed by the end token).

    Keys are the start token and the tokens so far joined by `sep` (the bare start token holds the
    first tokens); values are the sorted allowed next tokens. A sequence that is a prefix of another
    allows both its end token and the longer sequence's next token."""
    children: dict[str, set[int]] = {}
    for index, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {index} is empty")
        key = str(start_token_id)
        for token in seq:
            if int(token) in (start_token_id, end_token_id):
                raise ValueError(f"sequence {index} contains the start or end token {int(token)}")
            children.setdefault(key, set()).add(int(token))
            key = f"{key}{sep}{int(token)}"
        children.setdefault(key, set()).add(end_token_id)
    return {
        "start_token_id": start_token_id,
        "end_token_id": end_token_id,
        "sep": sep,
        "prefix_dict": {key: sorted(tokens) for key, tokens in children.items()},
    }


def catalog_prefix_dict(names: Iterable[str]) -> dict[str, Any]:
    """The prefix-dict config of a catalog of names under the demo tokenizer, rooted at `<root>`."""
    return build_prefix_dict(
        (_TOKENIZER.encode(name) for name in names), start_token_id=ROOT_ID, end_token_id=EOS_ID
    )


def load_tree_config(path: str | Path = TREE_PATH) -> dict[str, Any]:
    """The shipped prefix-dict config (`start_token_id`, `end_token_id`, `sep`, `prefix_dict`), or
    the one at `path` (UTF-8, with or without a byte-order mark: JSON reads bytes either way)."""
    return json.loads(Path(path).read_bytes())


def load_demo_model(
    which: str = "target", *, device: "str | torch.device | None" = None, dtype: "torch.dtype | None" = None
) -> "PreTrainedModel":
    """The demo's `target` or `draft` model as a Hugging Face causal LM in eval mode, loaded offline.

    The weights are stored in float16; `dtype` defaults to float32 because CPU matmuls in half
    precision are slow or missing."""
    import torch
    from transformers import AutoModelForCausalLM

    dirs = {"target": TARGET_DIR, "draft": DRAFT_DIR}
    if which not in dirs:
        raise ValueError(f"which must be 'target' or 'draft', got {which!r}")
    model = AutoModelForCausalLM.from_pretrained(
        dirs[which], local_files_only=True, dtype=torch.float32 if dtype is None else dtype
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    logger.debug("loaded demo %s model from %s", which, dirs[which])
    return model


def load_demo_models(
    *, device: "str | torch.device | None" = None, dtype: "torch.dtype | None" = None
) -> "tuple[PreTrainedModel, PreTrainedModel]":
    """`(target, draft)`: the demo's model pair, same tokenizer, for speculative decoding."""
    return (
        load_demo_model("target", device=device, dtype=dtype),
        load_demo_model("draft", device=device, dtype=dtype),
    )
