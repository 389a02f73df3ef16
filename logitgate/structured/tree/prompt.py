"""The one check an integration can make on a prefix-dict tree's prompt: RTP-LLM's tree decode
starts after `start_token_id`, so the prompt's last token must be it. A prompt that ends elsewhere
still decodes from the root (RTP-LLM's semantics), but the model writes a tree word without having
seen the token that introduces it, which usually gives poor words; the integrations warn once per
request where they can see the prompt (never per step)."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from .dfa import TreeDFA

logger = logging.getLogger(__name__)


def prompt_start_problem(tree: TreeDFA, prompt_ids: Sequence[int] | None) -> str | None:
    """Why `prompt_ids` do not end where the prefix-dict `tree` starts, or None (also for tries,
    sequences and an unknown prompt)."""
    start = tree.start_token_id
    if start is None or prompt_ids is None:
        return None
    if len(prompt_ids) == 0:
        return f"the prompt is empty; a prefix-dict tree starts after its start_token_id {start}"
    last = int(prompt_ids[-1])
    if last == start:
        return None
    return (
        f"the prompt ends in token {last}, not in the prefix dict's start_token_id {start}: decoding "
        f"starts at the tree's root as if {start} had been the last token (append {start} to the prompt)"
    )


def warn_prompt_start(tree: TreeDFA, prompt_ids: Sequence[int] | None, request: str) -> bool:
    """Log a warning naming `request` when its prompt does not end in the tree's start token;
    True when it warned."""
    problem = prompt_start_problem(tree, prompt_ids)
    if problem is not None:
        logger.warning("%s: %s", request, problem)
    return problem is not None
