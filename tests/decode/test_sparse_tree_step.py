"""tree_spec_step (verification over tree candidates) against the dense path: drafts the tree does
not allow (the reject column), draft probabilities or none; greedy token for token,
random draws by chi-square against the exact residual distribution."""
import numpy as np
import pytest
import torch

from logitgate import TreeDFA
from logitgate.decode.sparse_tree_step import tree_spec_step
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
from logitgate.sampling.rejection import parse_output, rejection_sample
from logitgate.sampling.spec_constraint import constrain_spec_logits
from logitgate.structured.constraint_state import TreeConstraint, fill_constraint_rows
from tests.helpers.stat_helpers import chisquare_pvalue

V, END = 40, 0
TREE = TreeDFA.from_sequences([[3, 4, 5], [3, 6], [7, 8], [9]], end_token_id=END, vocab_size=V)
DEVICE = TREE.device  # the default device: the logits go where the tree is


def layout(drafts):
    states = [s for d in drafts for s in TreeConstraint(TREE).walk_states(d)]
    return states


def dense(logits, drafts, metadata, draft_probs):
    counts = [len(d) for d in drafts]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=DEVICE)
    bitmask, rows = fill_constraint_rows([TreeConstraint(TREE) for _ in drafts], drafts, V, DEVICE)
    spec = constrain_spec_logits(logits, bitmask, flat, counts, rows=rows)
    bonus = Sampler()(spec.bonus_logits.clone(), metadata).sampled_token_ids.squeeze(1)
    out = rejection_sample(flat, counts, spec.target_logits, bonus, draft_probs=draft_probs, temperature=metadata.temperature,
                           top_k=metadata.top_k, top_p=metadata.top_p, generators=metadata.generators)
    return parse_output(out, V)


DRAFTS = [[3, 4], [3, 11], [12], [], [7, 8, 0], [3, 4, 5, 0], [9, 0, 0]]  # 11, 12: not in the tree


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_matches_the_dense_path(seed, with_probs):
    g = torch.Generator().manual_seed(seed)
    rows = sum(len(d) + 1 for d in DRAFTS)
    logits = torch.randint(-2, 3, (rows, V), generator=g).float().to(DEVICE)  # ties
    probs = torch.rand(rows - len(DRAFTS), V, generator=g).softmax(-1).to(DEVICE) if with_probs else None
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * len(DRAFTS), device=DEVICE)
    want = dense(logits.clone(), DRAFTS, md, probs)
    got = tree_spec_step(Sampler(), logits.clone(), TREE, layout(DRAFTS), DRAFTS, md, draft_probs=probs)
    assert got == want


def test_a_rejected_draft_is_replaced_from_the_constrained_residual():
    """Draft 12 (not in the tree) with draft probabilities: always rejected; the token in its
    place follows max(target - draft, 0) over the root's tokens, normalised."""
    g = torch.Generator().manual_seed(3)
    n = 6000
    drafts = [[12]] * n
    target_row, bonus_row = torch.randn(V, generator=g), torch.randn(V, generator=g)
    logits = torch.stack([target_row, bonus_row]).repeat(n, 1).to(DEVICE)
    q = torch.rand(V, generator=g)
    q[[3, 7]] *= 6  # the draft over-weights two allowed tokens: the residual differs from the target
    q = q / q.sum()
    md = SamplingMetadata.from_params([SamplingParams(temperature=1.0)] * n, device=DEVICE)
    torch.manual_seed(0)
    got = tree_spec_step(Sampler(), logits, TREE, layout(drafts), drafts, md, draft_probs=q.expand(n, V).clone().to(DEVICE))
    first = np.array([tokens[0] for tokens in got])
    assert all(len(t) == 1 for t in got)
    allowed = TREE.allowed(TREE.root)
    target = torch.softmax(target_row[allowed], 0)
    residual = (target - q[allowed]).clamp(min=0)
    expected = residual / residual.sum()
    counts = np.array([(first == t).sum() for t in allowed])
    assert counts.sum() == n
    keep = expected.numpy() * n >= 5
    obs = list(counts[keep]) + [counts[~keep].sum()]
    exp = list(expected.numpy()[keep] * n) + [expected.numpy()[~keep].sum() * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare_pvalue(obs, exp) > 1e-6


def test_logits_on_another_device_than_the_tree_are_named():
    """The sparse step reads the logits with the tree's kernels: logits elsewhere (CPU logits with a
    tree on CUDA, on the GPU check) are an error naming both devices, not a kernel's crash."""
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * len(DRAFTS), device=DEVICE)
    for drafts in (DRAFTS, [[] for _ in DRAFTS]):  # verification, and a step without drafts
        logits = torch.zeros(sum(len(d) + 1 for d in drafts), V, device="meta")
        with pytest.raises(ValueError, match=f"logits are on meta but the tree is on {DEVICE}"):
            tree_spec_step(Sampler(), logits, TREE, layout(drafts), drafts, md)
