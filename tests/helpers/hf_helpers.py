"""Checks on Hugging Face `generate` outputs of the demo models."""
import torch

from logitgate.models import EOS_ID, PAD_ID


def generated(row: torch.Tensor, prompt_width: int) -> list[int]:
    """The tokens after the prompt up to (not including) the EOS; everything after the EOS must be
    the pad token HF appends to finished rows."""
    tokens = row[prompt_width:].tolist()
    assert EOS_ID in tokens, f"no EOS in {tokens}"
    end = tokens.index(EOS_ID)
    assert all(t == PAD_ID for t in tokens[end + 1 :]), f"non-pad tokens after the EOS: {tokens}"
    return tokens[:end]


def assert_tree_path(tree, tokens: list[int]) -> None:
    """`tokens` then the end token is a path of the tree from its root to a finished state."""
    state = tree.root
    for position, token in enumerate([*tokens, tree.end_token_id]):
        assert token in tree.allowed(state), f"token {token} at position {position} is not allowed in {tokens}"
        state = tree.step(state, token)
    assert tree.is_finished(state)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left-padded with the pad token as HF expects for decoder-only models."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask
