"""Is a tree argument JSON text, or a name / path? One answer for every reader (the tree loaders, the
vLLM front end's name lookup): text whose first character, past a UTF-8 byte-order mark (files
saved by Notepad or PowerShell start with one) and whitespace, opens a JSON object or array. The
text itself is not read further. Import-light (the standard library only)."""
from __future__ import annotations

import re
from typing import Any

__all__ = ["is_json_text"]

_TEXT = re.compile(r"\ufeff?\s*[{\[]")
_BYTES = re.compile(rb"(?:\xef\xbb\xbf)?\s*[{\[]")


def is_json_text(value: Any) -> bool:
    """True for a str, bytes or bytearray that starts (BOM and whitespace aside) with "{" or "["."""
    if isinstance(value, str):
        return _TEXT.match(value) is not None
    if isinstance(value, (bytes, bytearray)):
        return _BYTES.match(value) is not None
    return False
