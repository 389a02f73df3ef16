"""Helpers for the sampling tests: the chi-square check every distribution test uses, whether Triton
runs interpreted, and which rejection-sampling decisions float rounding may flip."""
import numpy as np

from tests.helpers.stat_helpers import chisquare_pvalue

ALPHA = 1e-6


def chi_square_pvalue(samples, probs) -> float:
    """Goodness of fit of integer samples to `probs` (1-D, sums to 1); bins with expected counts
    below 5 are pooled, as the test requires."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"sampled zero-probability tokens {np.nonzero((probs == 0) & (counts > 0))[0]}"
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big & (probs > 0)).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return chisquare_pvalue(obs, exp)


def interpreted_triton(backend) -> bool:
    """The emulated NPU running Triton kernels under TRITON_INTERPRET=1: correct but slow, so the
    big-shape and many-example tests leave it to dedicated smaller tests."""
    return backend.device.type == "cpu" and backend.capabilities.triton


def near_decision(cu, drafts, logits, temperature, probs, uniform, rel=1e-4):
    """Per draft row: whether its acceptance ratio lies within `rel` of its uniform (float rounding
    may flip it)."""
    from logitgate.backends.reference import tempered_logits

    z = tempered_logits(logits, temperature).double()
    safe = drafts.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    p = (z.gather(-1, safe).squeeze(-1) - z.logsumexp(-1)).exp()
    q = p.new_ones(p.shape) if probs is None else probs.double().gather(-1, safe).squeeze(-1)
    return ((p / q - uniform).abs() <= rel * uniform).tolist()
