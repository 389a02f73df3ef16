"""Bench and check: tree fill, candidates and the sparse path's kernels vs their torch reference."""
from __future__ import annotations

from .timing import Timer, timed, us_fields


def bench_tree(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    import logitgate
    from logitgate import TreeDFA
    from logitgate.backends.base import CandidateRows

    from ..tree import batch_prefixes, make_catalog, prefix_dict_config

    batch, vocab, items = shapes["tree"]
    dev = backend.device
    from logitgate.backends import reference

    progress.step(f"tree fill, candidates, gather and keep B={batch} V={vocab}, {items} items")
    catalog = make_catalog(items)
    tree = TreeDFA.from_prefix_dict(prefix_dict_config(catalog), vocab_size=vocab, device=dev)
    prefixes = (batch_prefixes(catalog) * (batch // 64 + 1))[:batch]
    states = torch.tensor([tree.walk(p) for p in prefixes], device=dev)
    tokens = torch.full((batch,), 2, device=dev)
    bitmask = logitgate.allocate_token_bitmask(batch, vocab, device=dev)
    logits = torch.randn(batch, vocab, device=dev)

    def dense():
        tree.fill_bitmask(states, bitmask)
        logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=backend)

    def sparse_greedy():
        ids, valid = tree.candidates(states)
        picked = logits.gather(1, ids).masked_fill_(~valid, float("-inf")).argmax(1, keepdim=True)
        return ids.gather(1, picked)

    # The sparse path's kernels (Triton on CUDA) against the torch reference they replace, on one
    # layout of the batch's exact widths; keep works on its own copy of the logits.
    tree_args, width = tree_kernel_args(tree, states)
    kept = logits.clone()
    fill_args = (states, *tree.fill_layout())
    torch_bitmask = bitmask.clone()
    fns = {
        "fill_bitmask": lambda: tree.fill_bitmask(states, bitmask),
        "fill_bitmask_torch": lambda: reference.fill_tree_bitmask_reference(torch_bitmask, *fill_args),
        "fill_and_apply": dense,
        "candidates": lambda: tree.candidates(states),
        "candidates_greedy": sparse_greedy,
        "gather_candidates": lambda: backend.gather_candidate_logits(logits, CandidateRows(*tree_args, width)),
        "gather_candidates_torch": lambda: reference.gather_candidate_logits_reference(logits, *tree_args, width),
        "keep_only_allowed": lambda: backend.keep_candidate_logits(kept, CandidateRows(*tree_args, width)),
        "keep_only_allowed_torch": lambda: reference.keep_candidate_logits_reference(kept, *tree_args, width),
        "advance": lambda: tree.advance(states, tokens),
    }
    runs = timed(fns, timer, repeats)
    ms = {name: t.median for name, t in runs.items()}
    return [{"case": f"{items}-item prefix-dict tree, rows two tokens deep", "shape": f"{batch}x{vocab}",
             "max_width": tree.max_width, "layout_width": width, "impl": {name: us_fields(t) for name, t in runs.items()},
             "speedup_fill_vs_torch": ms["fill_bitmask_torch"] / ms["fill_bitmask"],
             "speedup_gather_vs_torch": ms["gather_candidates_torch"] / ms["gather_candidates"],
             "speedup_keep_vs_torch": ms["keep_only_allowed_torch"] / ms["keep_only_allowed"],
             "correct": tree_kernels_correct(backend, tree, states, logits, fill_args)}]


def tree_kernel_args(tree, states):
    """(rows, starts, widths, allow_tok) of every row of `states` in one sparse layout, and its
    width (the widest row, read once here, outside any timed or sync-checked part)."""
    import torch

    widths = tree.widths[states].long()
    rows = torch.arange(states.shape[0], device=states.device)
    return (rows, tree.allow_start[states], widths, tree.allow_tok), int(widths.max())


def tree_kernels_correct(backend, tree, states, logits, fill_args) -> dict[str, bool]:
    """The backend's tree kernels equal the torch reference on the benchmark's inputs."""
    import torch

    from logitgate.backends import reference
    from logitgate.backends.base import CandidateRows

    args, width = tree_kernel_args(tree, states)
    got_mask, want_mask = (torch.full((states.shape[0], (logits.shape[1] + 31) // 32), 7, dtype=torch.int32,
                                      device=logits.device) for _ in range(2))
    backend.fill_tree_bitmask(got_mask, *fill_args)
    reference.fill_tree_bitmask_reference(want_mask, *fill_args)
    got_keep, want_keep = logits.clone(), logits.clone()
    backend.keep_candidate_logits(got_keep, CandidateRows(*args, width))
    reference.keep_candidate_logits_reference(want_keep, *args, width)
    gathered = backend.gather_candidate_logits(logits, CandidateRows(*args, width))
    return {"fill_bitmask": torch.equal(got_mask, want_mask),
            "gather_candidates": torch.equal(gathered, reference.gather_candidate_logits_reference(logits, *args, width)),
            "keep_only_allowed": torch.equal(got_keep, want_keep)}
