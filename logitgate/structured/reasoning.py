"""Spotting a reasoning end marker (a token sequence such as the ids of "</think>") in a token stream."""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EndMarker"]


class EndMarker:
    """A token sequence matched incrementally, KMP style: `step(progress, token)` returns how many
    marker tokens the stream now ends with, so a marker split across steps or drafts is found and a
    false start ("</" "</think>") does not hide the real one."""

    __slots__ = ("tokens", "_fallback")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tuple(int(t) for t in tokens)
        if not self.tokens:
            raise ValueError("the reasoning end marker must contain at least one token id")
        # _fallback[i]: length of the longest proper prefix of tokens[:i+1] that is also its suffix.
        fallback = [0] * len(self.tokens)
        k = 0
        for i in range(1, len(self.tokens)):
            while k and self.tokens[i] != self.tokens[k]:
                k = fallback[k - 1]
            if self.tokens[i] == self.tokens[k]:
                k += 1
            fallback[i] = k
        self._fallback = fallback

    def __len__(self) -> int:
        return len(self.tokens)

    def step(self, progress: int, token: int) -> int:
        """Progress after `token`; equal to len(self) once the marker is complete."""
        if progress == len(self.tokens):
            progress = self._fallback[progress - 1]
        while progress and self.tokens[progress] != token:
            progress = self._fallback[progress - 1]
        return progress + 1 if self.tokens[progress] == token else 0
