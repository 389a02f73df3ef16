"""TreeDFA: a compiled, immutable, device-resident token tree (RTP-LLM prefix dicts, TokenTreePayload
token tries, plain token sequences).

RTP-LLM keeps tree-decode state as strings ("225_64000_64001") looked up in a global dict, and builds
a dense uint8 [B, V] mask on the host every step. Here the tree is compiled once into integer arrays
on the device: states are node ids, transitions are a sorted (node << 31 | token) edge list searched
in one `searchsorted`, allowed sets are CSR rows (the widest optionally kept as precomputed bitmask
rows). A decode step is a handful of tensor ops with no host synchronisation.

States: 0 is the root; `error_state` (after a token the tree does not know: only the end token is
allowed) and `finished_state` (after the end token: nothing changes) come after the nodes.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...backends import Backend, get_backend
from ...backends.formats import gather_csr_rows
from ...checks import is_integer
from ..compile_cache import LRUCache, content_hash
from .graph import CODE_SHIFT, CompiledTree, TreeGraph, compile_graph, prefix_dict_graph, sequences_graph
from .limits import TreeLimits, cache_bytes_from_env
from .loaders import (
    INT32_MAX,
    PrefixDictSpec,
    SequenceSpec,
    check_token_id,
    check_vocab_size,
    parse_json_bytes,
    parse_prefix_dict,
    parse_sequences,
    parse_token_trie,
    prefix_dict_size,
    quote_key,
    read_json_source,
    sequences_size,
    tokenize_strings,
)

__all__ = ["TreeDFA"]

logger = logging.getLogger(__name__)

DEFAULT_DENSE_MIN_WIDTH = 256  # nodes allowing at least this many tokens may keep a bitmask row
DEFAULT_DENSE_BUDGET_BYTES = 64 << 20  # memory for those rows, per tree
DEFAULT_CACHE_SIZE = 32  # trees; the byte bound (LOGITGATE_TREE_CACHE_BYTES, limits.py) also applies
_DENSE_BUILD_ENTRIES = 1 << 22  # padded entries per chunk when building the dense rows

# Made on first use, so that the byte bound is read from the environment then (not at import).
_cache: LRUCache[TreeDFA] | None = None


def _the_cache() -> LRUCache[TreeDFA]:
    global _cache
    if _cache is None:
        _cache = LRUCache(DEFAULT_CACHE_SIZE, max_bytes=cache_bytes_from_env(), sizeof=lambda tree: tree.nbytes)
    return _cache


@dataclass(frozen=True)
class _Options:
    """What besides the tree's content decides the compiled form (and so the cache key)."""

    vocab_size: int | None
    dense_min_width: int
    dense_budget_bytes: int
    backend: Backend
    limits: TreeLimits  # not in the key: limits decide whether a tree is built, not what it compiles to

    def key(self) -> tuple:
        # The cached tree holds its backend, so the id cannot be reused while the entry lives.
        b = self.backend
        backend_key = (type(b).__qualname__, str(b.device), id(b))
        return (self.vocab_size, self.dense_min_width, self.dense_budget_bytes, backend_key)

    def compile(self, graph: TreeGraph, end_token_id: int) -> CompiledTree:
        return compile_graph(graph, end_token_id, self.vocab_size, self.dense_min_width, self.dense_budget_bytes)


def _options(vocab_size, dense_min_width, dense_budget_bytes, device, limits: TreeLimits | None) -> _Options:
    if limits is not None and not isinstance(limits, TreeLimits):
        raise ValueError(f"limits must be a TreeLimits or None, got {type(limits).__name__}")
    limits = TreeLimits.from_env() if limits is None else limits
    return _Options(vocab_size, dense_min_width, dense_budget_bytes, get_backend(device), limits)


class TreeDFA:
    """A compiled token tree. Build one with `from_prefix_dict`, `from_token_trie`,
    `from_sequences`, `from_strings` or `from_parsed` (compiled trees are cached by content, within a byte bound).

    Every constructor takes `limits=` (a TreeLimits; default `TreeLimits.from_env()`, i.e.
    LOGITGATE_TREE_MAX_BYTES / _NODES / _DEPTH): a larger tree raises TreeTooLarge (a ValueError)
    before the work the limit protects (limits.py)."""

    def __init__(self, compiled: CompiledTree, *, kind: str, backend: Backend, vocab_size: int | None) -> None:
        """Internal: use the `from_*` constructors."""
        self._host = compiled
        self.kind = kind
        self.backend = backend
        self.device = backend.device
        self.vocab_size = vocab_size
        self.end_token_id = compiled.end_token_id
        self.error_state = compiled.error_state
        self.finished_state = compiled.finished_state
        self.num_states = compiled.num_states
        widths = compiled.widths
        fill_width = widths.copy()
        fill_width[compiled.dense_nodes] = 0
        self.max_width = int(widths.max())
        self._fill_max_width = int(fill_width.max())
        dev = self.device

        def put(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=dev, dtype=dtype)

        self._trans_code = put(compiled.trans_code, torch.int64)
        self._trans_dst = put(compiled.trans_dst, torch.int64)
        self._allow_start = put(compiled.allow_ptr[:-1], torch.int64)
        self._allow_tok = put(compiled.allow_tok, torch.int32)
        self._width = put(widths, torch.int32)
        self._fill_width = put(fill_width, torch.int32)
        self._frozen = put(compiled.frozen, torch.bool)
        self._dense_rows, self._dense_slot = self._build_dense_rows(compiled.dense_nodes, widths)

    def _build_dense_rows(self, dense_nodes: np.ndarray, widths: np.ndarray):
        if not len(dense_nodes):
            return None, None
        words = self._host.vocab_words
        rows = torch.zeros(len(dense_nodes) + 1, words, dtype=torch.int32, device=self.device)  # row 0: none
        slot = np.zeros(self.num_states, np.int64)
        slot[dense_nodes] = np.arange(1, len(dense_nodes) + 1)
        nodes = torch.from_numpy(dense_nodes).to(self.device)
        chunk = max(1, _DENSE_BUILD_ENTRIES // int(widths[dense_nodes].max()))
        for lo in range(0, len(dense_nodes), chunk):
            part = nodes[lo : lo + chunk]
            width = int(widths[dense_nodes[lo : lo + chunk]].max())
            out = rows[1 + lo : 1 + lo + len(part)]
            self.backend.fill_tree_bitmask(
                out, part, self._allow_start, self._allow_tok, self._width, width, None, None
            )
        return rows, torch.from_numpy(slot).to(self.device)

    # ------------------------------------------------------------------------------------------
    # constructors

    @classmethod
    def from_prefix_dict(
        cls,
        config: Any,
        *,
        vocab_size: int | None = None,
        device: str | torch.device | Backend | None = None,
        dense_min_width: int = DEFAULT_DENSE_MIN_WIDTH,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
        cache: bool = True,
        limits: TreeLimits | None = None,
    ) -> TreeDFA:
        """An RTP-LLM tree-decode config: a path, a JSON string or a dict with `start_token_id`,
        `end_token_id`, `sep` (default "_") and `prefix_dict` ("225_64000": [64001, 64002], ...).
        Semantics are RTP-LLM's exactly; unreachable keys are dropped (counted in `stats()`)."""
        opts = _options(vocab_size, dense_min_width, dense_budget_bytes, device, limits)
        check_vocab_size(vocab_size)
        obj, raw, where = read_json_source(config, "prefix dict config", opts.limits)
        if raw is not None:  # hash the text first: a cache hit skips parsing too
            key = ("prefix_dict", content_hash(raw), opts.key())
            return cls._cached(key, lambda: cls._build_prefix_dict(parse_prefix_dict(parse_json_bytes(raw, where), vocab_size), opts), cache)
        return cls._from_prefix_spec(parse_prefix_dict(obj, vocab_size), opts, cache)

    @classmethod
    def _from_prefix_spec(cls, spec: PrefixDictSpec, opts: _Options, cache: bool) -> TreeDFA:
        arrays = (spec.part_ids, spec.part_offsets, spec.cand_ids, spec.cand_offsets)
        key = ("prefix_dict", content_hash(spec.start_token_id, spec.end_token_id, spec.sep, *arrays), opts.key())
        return cls._cached(key, lambda: cls._build_prefix_dict(spec, opts), cache)

    @classmethod
    def _build_prefix_dict(cls, spec: PrefixDictSpec, opts: _Options) -> TreeDFA:
        opts.limits.check_size(prefix_dict_size(spec), "prefix dict")  # before the trie is built
        graph = prefix_dict_graph(spec)
        if graph.info["unreachable_keys"]:
            logger.warning(
                "prefix dict: %d of %d keys can never be reached (other start token, a missing "
                "intermediate key, or a token after the end token), e.g. %s",
                graph.info["unreachable_keys"], graph.info["keys"],
                graph.info["unreachable_examples"],  # quoted short by prefix_dict_graph (quote_key)
            )
        compiled = opts.compile(graph, spec.end_token_id)
        compiled.info.update(start_token_id=spec.start_token_id, sep=spec.sep)
        return cls(compiled, kind="prefix_dict", backend=opts.backend, vocab_size=opts.vocab_size)

    @classmethod
    def from_parsed(
        cls,
        spec: PrefixDictSpec | SequenceSpec,
        *,
        end_token_id: int | None = None,
        vocab_size: int | None = None,
        device: str | torch.device | Backend | None = None,
        dense_min_width: int = DEFAULT_DENSE_MIN_WIDTH,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
        cache: bool = True,
        limits: TreeLimits | None = None,
    ) -> TreeDFA:
        """A tree the loaders have already parsed and checked for `vocab_size` (structured/tree/shape.py's
        `parse_arrays`, run in another process): a PrefixDictSpec, or a token trie's SequenceSpec with
        `end_token_id`. Built and cached as `from_prefix_dict` / `from_token_trie` build the same
        tree; the JSON parse, which holds Python's GIL, happened elsewhere."""
        opts = _options(vocab_size, dense_min_width, dense_budget_bytes, device, limits)
        check_vocab_size(vocab_size)
        if isinstance(spec, PrefixDictSpec):
            return cls._from_prefix_spec(spec, opts, cache)
        if not isinstance(spec, SequenceSpec) or end_token_id is None:
            raise ValueError("from_parsed takes a PrefixDictSpec, or a SequenceSpec with end_token_id")
        return cls._from_spec(spec, "token_trie", end_token_id, opts, cache)

    @classmethod
    def from_sequences(
        cls,
        sequences: Iterable[Sequence[int]],
        *,
        end_token_id: int,
        vocab_size: int | None = None,
        device: str | torch.device | Backend | None = None,
        dense_min_width: int = DEFAULT_DENSE_MIN_WIDTH,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
        cache: bool = True,
        names: Sequence[str] | None = None,
        limits: TreeLimits | None = None,
    ) -> TreeDFA:
        """A token trie of allowed sequences (lists of token ids). Where a sequence ends the end
        token is allowed too (a sequence that is a prefix of another both ends and continues); a
        completed sequence with no continuation allows only the end token. `names` label the
        sequences in error messages."""
        opts = _options(vocab_size, dense_min_width, dense_budget_bytes, device, limits)
        spec = parse_sequences(sequences, end_token_id, vocab_size, names)
        return cls._from_spec(spec, "sequences", end_token_id, opts, cache)

    @classmethod
    def from_token_trie(
        cls,
        payload: Any,
        *,
        end_token_id: int,
        path: str | None = None,
        model_id: str | None = None,
        vocab_size: int | None = None,
        device: str | torch.device | Backend | None = None,
        dense_min_width: int = DEFAULT_DENSE_MIN_WIDTH,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
        cache: bool = True,
        limits: TreeLimits | None = None,
    ) -> TreeDFA:
        """A TokenTreePayload ({"modelId", "descriptors": [{"path", "leaves": [{"name", "tokens"}]}]}),
        as a path, JSON string or dict. `path=` picks the descriptor when there are several;
        `model_id=` rejects a payload built for another model. Leaves behave as `from_sequences`."""
        opts = _options(vocab_size, dense_min_width, dense_budget_bytes, device, limits)
        parsed = parse_token_trie(payload, path=path, model_id=model_id, limits=opts.limits)
        labels = ["None" if v is None else repr(quote_key(v)) for v in (parsed.model_id, parsed.path)]
        where = f"token trie payload (model {labels[0]}, path {labels[1]})"
        spec = parse_sequences(parsed.sequences, end_token_id, vocab_size, parsed.names, what=where)
        return cls._from_spec(spec, "token_trie", end_token_id, opts, cache)

    @classmethod
    def from_strings(
        cls,
        strings: Iterable[str],
        tokenizer: Callable[[str], Any],
        *,
        end_token_id: int,
        vocab_size: int | None = None,
        device: str | torch.device | Backend | None = None,
        **options: Any,
    ) -> TreeDFA:
        """Allowed strings, tokenised with `tokenizer(s) -> token ids`, or with a Hugging Face tokenizer
        (transformers' or `tokenizers`') given as is: it is asked for no special tokens, and a string
        that still tokenizes to one (BOS, EOS, ...) raises ValueError. Then as `from_sequences`."""
        sequences, names = tokenize_strings(strings, tokenizer)
        return cls.from_sequences(
            sequences, end_token_id=end_token_id, vocab_size=vocab_size, device=device, names=names, **options
        )

    @classmethod
    def _from_spec(cls, spec: SequenceSpec, kind: str, end_token_id: int, opts: _Options, cache: bool) -> TreeDFA:
        end = int(end_token_id)
        opts.limits.check_size(sequences_size(np.diff(spec.offsets)), kind.replace("_", " "))  # before the trie
        key = (kind, content_hash(spec.token_ids, spec.offsets, end), opts.key())

        def build() -> TreeDFA:
            compiled = opts.compile(sequences_graph(spec, end), end)
            return cls(compiled, kind=kind, backend=opts.backend, vocab_size=opts.vocab_size)

        return cls._cached(key, build, cache)

    @staticmethod
    def _cached(key: tuple, build: Callable[[], TreeDFA], cache: bool) -> TreeDFA:
        return _the_cache().get_or_create(key, build) if cache else build()

    @staticmethod
    def cache_info() -> dict[str, int]:
        """The process-wide compile cache: trees held ("size") and their bound ("maxsize"), the bytes
        they hold ("bytes", TreeDFA.nbytes summed) and the bound ("max_bytes"), hits and misses."""
        return _the_cache().info()

    @staticmethod
    def cache_clear() -> None:
        """Drop every cached tree (trees in use elsewhere stay valid) and reset the counters."""
        _the_cache().clear()

    @staticmethod
    def set_cache_size(maxsize: int | None = None, *, max_bytes: int | None = None) -> None:
        """Bound the compile cache to `maxsize` trees (default DEFAULT_CACHE_SIZE) and `max_bytes`
        bytes (default LOGITGATE_TREE_CACHE_BYTES, else 256 MiB); 0 for either disables caching.
        The least recently used trees are dropped first; a tree larger than `max_bytes` is built
        but not kept. Clears the cache."""
        global _cache
        _cache = LRUCache(
            DEFAULT_CACHE_SIZE if maxsize is None else maxsize,
            max_bytes=cache_bytes_from_env() if max_bytes is None else max_bytes,
            sizeof=lambda tree: tree.nbytes,
        )

    # ------------------------------------------------------------------------------------------
    # read-only face for the layers that lay out and sample a step (candidates.py, the decode
    # step, the vLLM route): the compiled arrays, never to be written

    @property
    def host(self) -> CompiledTree:
        """The compiled tree's host (numpy) arrays: CSR of allowed tokens (`allow_ptr`,
        `allow_tok`), transitions, per-node widths and depths. Shared with the compile cache:
        read only."""
        return self._host

    @property
    def allow_tok(self) -> torch.Tensor:
        """int32 (total allowed,) on the tree's device: every state's allowed tokens, sorted within
        a state; state s owns allow_tok[allow_start[s] : allow_start[s] + widths[s]]."""
        return self._allow_tok

    @property
    def allow_start(self) -> torch.Tensor:
        """int64 (num_states,) on the tree's device: where each state's allowed tokens start in allow_tok."""
        return self._allow_start

    @property
    def widths(self) -> torch.Tensor:
        """int32 (num_states,) on the tree's device: allowed tokens per state."""
        return self._width

    # ------------------------------------------------------------------------------------------
    # scalar API (host arrays; for tests, tools and the jump-forward of a decode loop)

    @property
    def root(self) -> int:
        return 0

    @property
    def max_token_id(self) -> int:
        """The largest token id the tree allows or steps on (the end token included); logits need
        more columns than this."""
        return int(self._host.info["max_token_id"])

    @property
    def start_token_id(self) -> int | None:
        """A prefix dict's start token (the prompt's last token: the tree begins after it); None for
        token tries and sequences."""
        start = self._host.info.get("start_token_id")
        return None if start is None else int(start)

    def _check_state(self, state: int) -> int:
        if not is_integer(state) or not 0 <= state < self.num_states:
            raise ValueError(f"state {state!r} is not a state of this tree (0 <= state < {self.num_states})")
        return int(state)

    def allowed(self, state: int) -> list[int]:
        """The token ids allowed in `state`, sorted."""
        s = self._check_state(state)
        ptr = self._host.allow_ptr
        return self._host.allow_tok[ptr[s] : ptr[s + 1]].tolist()

    def step(self, state: int, token: int) -> int:
        """The state after `token`: the child on that token; else `finished_state` for the end token;
        else `error_state`. Finished states never change."""
        s = self._check_state(state)
        t = check_token_id(token, "token", self.vocab_size)
        host = self._host
        if host.frozen[s]:
            return s
        code = (s << CODE_SHIFT) | t
        pos = int(np.searchsorted(host.trans_code, code))
        if host.trans_code[pos] == code:
            return int(host.trans_dst[pos])
        return self.finished_state if t == self.end_token_id else self.error_state

    def walk(self, tokens: Iterable[int], state: int | None = None) -> int:
        """The state after stepping through `tokens` from `state` (default: the root)."""
        s = self.root if state is None else state
        for t in tokens:
            s = self.step(s, t)
        return s

    def is_finished(self, state: int) -> bool:
        """True once the end token was taken (the state no longer changes)."""
        return bool(self._host.frozen[self._check_state(state)])

    def forced_tokens(self, state: int, max_len: int) -> list[int]:
        """The unique continuation from `state`: while exactly one token is allowed, that token, in
        order (the end token included, and last). A decode loop can append them without forward
        passes (jump-forward), or use them as drafts that are always accepted."""
        if not is_integer(max_len) or max_len < 0:
            raise ValueError(f"max_len must be an int >= 0, got {max_len!r}")
        s = self._check_state(state)
        ptr, tok, out = self._host.allow_ptr, self._host.allow_tok, []
        while len(out) < max_len and not self._host.frozen[s] and ptr[s + 1] - ptr[s] == 1:
            t = int(tok[ptr[s]])
            out.append(t)
            s = self.step(s, t)
        return out

    # ------------------------------------------------------------------------------------------
    # batched API (device tensors, no host synchronisation)

    def initial_states(self, batch_size: int) -> torch.Tensor:
        """int64 (batch_size,) root states on the tree's device."""
        return torch.full((batch_size,), self.root, dtype=torch.int64, device=self.device)

    def check_device(self, tensor: torch.Tensor, name: str) -> None:
        """ValueError naming `name` (plural: "logits", "states") unless `tensor` is on the tree's
        device: the tree's kernels read it there."""
        if tensor.device != self.device:
            raise ValueError(f"{name} are on {tensor.device} but the tree is on {self.device}")

    def check_states(self, states: torch.Tensor, name: str = "states") -> torch.Tensor:
        """`states` (returned as given) if it is a 1-D int32/int64 tensor on the tree's device;
        ValueError otherwise, and, for states on the host (where it is free), for an entry that is
        not a state of this tree. `name` names the argument in the message."""
        if not isinstance(states, torch.Tensor) or states.dtype not in (torch.int32, torch.int64) or states.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor")
        self.check_device(states, name)
        if name == "states" and states.device.type == "cpu" and not torch.equal(states.clamp(0, self.num_states - 1), states):
            # Free on the host (a negative state would wrap to another one); on a device it would
            # be a sync, so there states are the caller's responsibility.
            bad = ((states < 0) | (states >= self.num_states)).nonzero()
            if bad.numel():
                row = int(bad[0, 0])
                raise ValueError(
                    f"states[{row}] = {int(states[row])} is not a state of this tree (0 <= state < {self.num_states})"
                )
        return states

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """New states after each row's token (same dtype as `states`). A beam that forks copies its
        parent's state (`states[parent_rows]`); nothing else is shared. Tokens outside the id range
        lead to the error state. States must come from this tree: checked on CPU (ValueError naming
        the row), not on a device (that would sync; an invalid state there gives undefined rows)."""
        self.check_states(states)
        self.check_states(tokens, "tokens")
        if tokens.shape != states.shape:
            raise ValueError(f"tokens have shape {tuple(tokens.shape)} but states {tuple(states.shape)}")
        s, t = states.long(), tokens.long()
        code = (s << CODE_SHIFT) | t.clamp(0, INT32_MAX)
        pos = torch.searchsorted(self._trans_code, code)  # the sentinel keeps pos in range
        hit = (self._trans_code[pos] == code) & (t >= 0) & (t <= INT32_MAX)
        fallback = torch.where(t == self.end_token_id, self.finished_state, self.error_state)
        nxt = torch.where(hit, self._trans_dst[pos], fallback)
        return torch.where(self._frozen[s], s, nxt).to(states.dtype)

    def finished(self, states: torch.Tensor) -> torch.Tensor:
        """bool (B,): which rows took the end token."""
        return self._frozen[self.check_states(states).long()]

    def fill_bitmask(self, states: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Write each row's allowed set into `bitmask` (int32 (B, W), xgrammar's format, W at least
        ceil(V/32) for the tree's vocabulary), in place; apply it with
        `logitgate.apply_token_bitmask_inplace`."""
        self.check_states(states)
        if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
            raise ValueError("bitmask must be a 2-D int32 tensor")
        if bitmask.shape[0] != states.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {states.shape[0]} states")
        if bitmask.shape[1] < self._host.vocab_words:
            raise ValueError(
                f"bitmask has {bitmask.shape[1]} words per row; this tree needs {self._host.vocab_words} "
                f"(token ids up to {self._host.vocab_words * 32 - 1})"
            )
        if bitmask.device != self.device or not bitmask.is_contiguous():
            raise ValueError(f"bitmask must be contiguous on {self.device}")
        self.backend.fill_tree_bitmask(bitmask, states.long(), *self.fill_layout())

    def fill_layout(self) -> tuple:
        """What `Backend.fill_tree_bitmask` takes after (bitmask, states): allow_start, allow_tok,
        the fill widths (per state, their maximum) and the dense rows (or None). For the kernel
        checks and benchmarks that call a backend's kernel or its reference directly."""
        return (self._allow_start, self._allow_tok, self._fill_width, self._fill_max_width,
                self._dense_rows, self._dense_slot)

    def candidates(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_ids int64 (B, max_width), valid bool (B, max_width)): each row's allowed tokens,
        sorted, padded to the tree's widest state by repeating the row's first token (so
        `logits.gather(1, token_ids)` is always safe; mask with `valid` before sampling). The cost is
        B x max_width, independent of the vocabulary size."""
        self.check_states(states)
        tok, valid = gather_csr_rows(states.long(), self._allow_start, self._width, self._allow_tok, self.max_width)
        return tok.long(), valid

    # ------------------------------------------------------------------------------------------
    # introspection

    def _device_tensors(self) -> list[torch.Tensor]:
        tensors = [self._trans_code, self._trans_dst, self._allow_start, self._allow_tok, self._width]
        tensors += [self._fill_width, self._frozen]
        return tensors + ([self._dense_rows, self._dense_slot] if self._dense_rows is not None else [])

    @property
    def nbytes(self) -> int:
        """Memory this tree holds: its host arrays and its device tensors (dense bitmask rows
        included), each buffer counted once (on CPU the tensors share the host arrays' memory)."""
        host = self._host
        arrays = (host.trans_code, host.trans_dst, host.allow_ptr, host.allow_tok, host.frozen, host.depth, host.dense_nodes)
        buffers: dict[tuple[str, int], int] = {}
        for a in arrays:
            while isinstance(a.base, np.ndarray):  # a view: count the array that owns the memory
                a = a.base
            key = ("cpu", a.__array_interface__["data"][0])
            buffers[key] = max(buffers.get(key, 0), a.nbytes)
        for t in self._device_tensors():
            storage = t.untyped_storage()
            key = ("cpu" if t.device.type == "cpu" else str(t.device), storage.data_ptr())
            buffers[key] = max(buffers.get(key, 0), storage.nbytes())
        return sum(buffers.values())

    def stats(self) -> dict[str, Any]:
        """Sizes, depth, branching histogram (allowed tokens per node) and device memory."""
        host = self._host
        widths = host.widths[: host.num_nodes]
        device_bytes = sum(t.numel() * t.element_size() for t in self._device_tensors())
        dense_rows = len(host.dense_nodes)
        return {
            "kind": self.kind,
            "nodes": host.num_nodes,
            "states": self.num_states,
            "transitions": len(host.trans_code) - 1,
            "allowed_entries": len(host.allow_tok),
            "max_depth": int(host.depth.max()),
            "max_width": self.max_width,
            "sparse_fill_width": self._fill_max_width,
            "branching": branching_histogram(widths),
            "dense_rows": dense_rows,
            "dense_bytes": 0 if self._dense_rows is None else self._dense_rows.numel() * 4,
            "device": str(self.device),
            "device_bytes": device_bytes,
            "bytes_per_node": device_bytes / max(host.num_nodes, 1),
            "vocab_size": self.vocab_size,
            "end_token_id": self.end_token_id,
            **host.info,
        }

    def __repr__(self) -> str:
        return f"<TreeDFA {self.kind}: {self._host.num_nodes} nodes, max width {self.max_width}, on {self.device}>"


def branching_histogram(widths: np.ndarray) -> dict[str, int]:
    """Counts of nodes by allowed-set size, in power-of-two buckets ("1", "2", "3-4", "5-8", ...)."""
    out: dict[str, int] = {}
    if not len(widths):
        return out
    buckets = np.ceil(np.log2(np.maximum(widths, 1))).astype(np.int64)
    for b, count in enumerate(np.bincount(buckets)):
        if count:
            lo, hi = (1, 1) if b == 0 else (2 ** (b - 1) + 1, 2**b)
            out[str(lo) if lo == hi else f"{lo}-{hi}"] = int(count)
    return out
