"""Pure-Python reference models for tree decode, written from the systems' behaviour, not from
logitgate's code.

RtpStringTreeDFA models RTP-LLM's TreeDFA<std::string, int> over PrefixToCandidateTokens: the state
is a string key; candidates are the key's set, or [end] when the key is missing or its set empty;
a token moves to key + sep + str(token) when that key exists or the token is the end token;
otherwise the DFA enters the error state "ERROR" (no key can start with it, so only the end token is
allowed and only the end token leaves it); after the end token nothing changes. (RTP-LLM's
constructor pre-fills its history with ten zeros, which makes a fresh DFA look finished when the end
token is 0; that quirk is not modelled.)

SequenceTrieModel is the token-trie semantics: allowed = the next tokens of the sequences that
extend the prefix, plus the end token where the prefix is itself a sequence.
"""
from __future__ import annotations

ERROR = "ERROR"


class RtpStringTreeDFA:
    def __init__(self, prefix_dict: dict[str, list[int]], start_token_id: int, end_token_id: int, sep: str = "_"):
        self.prefix_dict = {k: set(v) for k, v in prefix_dict.items()}
        self.end = end_token_id
        self.sep = sep
        self.status = str(start_token_id)
        self.input_list: list[int] = []

    def is_finished(self) -> bool:
        return bool(self.input_list) and self.input_list[-1] == self.end

    def candidates(self) -> list[int]:
        cands = self.prefix_dict.get(self.status)
        return sorted(cands) if cands else [self.end]

    def next(self, token: int) -> str:
        if self.is_finished():
            return self.status
        new_status = self.status + self.sep + str(token)
        if new_status in self.prefix_dict or token == self.end:
            self.input_list.append(token)
            self.status = new_status
        else:
            self.status = ERROR
        return self.status


class SequenceTrieModel:
    def __init__(self, sequences: list[list[int]], end_token_id: int):
        self.sequences = [tuple(s) for s in sequences]
        self.end = end_token_id
        self.prefix: tuple[int, ...] | None = ()  # None = error state
        self.finished = False

    def candidates(self) -> list[int]:
        if self.finished or self.prefix is None:
            return [self.end]
        n = len(self.prefix)
        out = {s[n] for s in self.sequences if len(s) > n and s[:n] == self.prefix}
        if self.prefix in self.sequences:
            out.add(self.end)
        return sorted(out)

    def next(self, token: int) -> None:
        if self.finished:
            return
        if token == self.end:
            self.finished = True
        elif self.prefix is not None and any(s[: len(self.prefix) + 1] == self.prefix + (token,) for s in self.sequences):
            self.prefix = self.prefix + (token,)
        else:
            self.prefix = None
