"""Token trees: TreeDFA and everything that builds, walks and lays out one.

    limits.py          the operator's limits on a tree (LOGITGATE_TREE_MAX_*) and its compile cache
                       (standard library only: vLLM's plugin and front end import it at start-up)
    loaders.py         reading and validating the inputs (prefix dicts, token tries, sequences) and
                       counting them against the limits before a trie is built (numpy only)
    shape.py           a tree's size and ends, checked without compiling (what vLLM's front end
                       admits, in its process or in its admission process)
    graph.py           the trie and its compiled arrays (numpy); trie_kernels.py its numba kernels
    dfa.py             TreeDFA: the compiled, immutable, device-resident tree
    cursor.py          TreeCursor: one request's position in a tree, shared by every route
    request.py         the request format every route accepts (TreeRequest, tree_request)
    candidates.py      a batch's candidate plan (sparse width groups, dense rows)
    prompt.py          the check that a prompt ends in the tree's start token
    grammar_backend.py TreeGrammar / TreeBackend: a tree as the grammar backend "tree"

The names load on first use (PEP 562): importing `limits` must not load torch or numba."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "TreeCursor": ".cursor",
    "TreeDFA": ".dfa",
    "TreeBackend": ".grammar_backend",
    "TreeGrammar": ".grammar_backend",
    "TreeLimits": ".limits",
    "TreeTooLarge": ".limits",
    "TREE_ARG_KEYS": ".request",
    "TreeRequest": ".request",
    "tree_request": ".request",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .cursor import TreeCursor
    from .dfa import TreeDFA
    from .grammar_backend import TreeBackend, TreeGrammar
    from .limits import TreeLimits, TreeTooLarge
    from .request import TREE_ARG_KEYS, TreeRequest, tree_request
