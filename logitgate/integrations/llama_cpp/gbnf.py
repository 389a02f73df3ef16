"""The same constraints as llama.cpp GBNF grammars (`llama_cpp.LlamaGrammar.from_string`), to
compare logitgate with llama.cpp's own grammar sampler: token-level (`<[id]>` terminals: exactly
the tree's paths, so greedy outputs match token for token) and text-level (the strings as
literals: what a llama.cpp user writes; the grammar then also accepts other tokenizations)."""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence


def _trie(sequences: Iterable[Sequence[int]]) -> dict:
    root: dict = {}
    for seq in sequences:
        node = root
        for token in seq:
            node = node.setdefault(int(token), {})
        node[None] = {}  # a sequence ends here
    return root


def gbnf_for_sequences(sequences: Iterable[Sequence[int]]) -> str:
    """A GBNF grammar whose token sequences are exactly `sequences`, written as a trie (one rule per
    branching node), so llama.cpp's grammar keeps one parse stack per live prefix, not one per
    sequence."""
    rules: list[str] = []

    def rule(node: dict) -> str:
        name = f"n{len(rules)}"
        rules.append("")
        index = len(rules) - 1
        options = []
        for token, child in sorted(node.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if token is None:
                options.append('""')
                continue
            chain = [f"<[{token}]>"]
            while len(child) == 1 and None not in child:  # a chain of single children: inline it
                (token, child), = child.items()
                chain.append(f"<[{token}]>")
            if child and not (len(child) == 1 and None in child):
                chain.append(rule(child))
            elif not child:
                raise ValueError("a trie node without an end marker")
            options.append(" ".join(chain))
        rules[index] = f"{name} ::= " + " | ".join(options)
        return name

    top = rule(_trie(sequences))
    return f"root ::= {top}\n" + "\n".join(rules) + "\n"


def gbnf_for_strings(strings: Iterable[str]) -> str:
    """`root ::= "a" | "b" | ...`: the strings as text literals (JSON escapes are valid GBNF escapes)."""
    literals = [json.dumps(s, ensure_ascii=False) for s in strings]
    if not literals:
        raise ValueError("no strings")
    return "root ::= " + " | ".join(literals) + "\n"
