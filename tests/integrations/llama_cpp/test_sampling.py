"""Sampled mode follows the masked distribution: llama.cpp's temperature over the valid set only
(chi-square, alpha 1e-6), through create_completion and through the skip-ahead loop."""
import numpy as np
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import logits_after
from tests.helpers.stat_helpers import chisquare_pvalue

scipy_stats = pytest.importorskip("scipy.stats")

WORDS = [" red", " green", " blue", " black", " white", " pink"]  # one token each


def expected_probs(llm, prompt_ids, first_tokens, temperature):
    logits = logits_after(llm, prompt_ids)[first_tokens].astype(np.float64) / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


def test_sampled_mode_follows_the_masked_distribution(llm):
    prompt_ids = llm.tokenize(b"My favourite colour is")
    first = [llm.tokenize(w.encode(), add_bos=False, special=False) for w in WORDS]
    assert all(len(t) == 1 for t in first)
    first = [t[0] for t in first]
    raw = logits_after(llm, prompt_ids)[first]
    temperature = float(np.std(raw)) * 1.5 + 1e-3  # keeps every cell's expected count well above 5
    probs = expected_probs(llm, prompt_ids, first, temperature)
    constraint = constrain(llm, strings=WORDS, mode="sampled")
    n = 1500
    counts = np.zeros(len(WORDS))
    for seed in range(n):
        out = llm.create_completion(
            prompt_ids, max_tokens=1, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
            repeat_penalty=1.0, seed=seed, logits_processor=constraint.processors(),
        )
        counts[WORDS.index(out["choices"][0]["text"])] += 1
    assert (probs * n).min() > 5
    assert chisquare_pvalue(counts, probs * n) > 1e-6, (counts, probs * n)


def test_skip_ahead_sampling_follows_the_masked_distribution(llm):
    prompt_ids = llm.tokenize(b"My favourite colour is")
    # two-token items sharing nothing after the first token: the second token is forced
    words = [w + " paint" for w in WORDS]
    first = [llm.tokenize(w.encode(), add_bos=False)[0] for w in WORDS]
    raw = logits_after(llm, prompt_ids)[first]
    temperature = float(np.std(raw)) * 1.5 + 1e-3
    probs = expected_probs(llm, prompt_ids, first, temperature)
    constraint = constrain(llm, strings=words, mode="sampled")
    n = 600
    counts = np.zeros(len(WORDS))
    for seed in range(n):
        result = generate(llm, prompt_ids, constraint, max_tokens=8, temperature=temperature, seed=seed)
        assert result.text in words
        assert result.forward_passes == 0 and result.forced_tokens == 2  # " paint" and EOS: no pass
        counts[words.index(result.text)] += 1
    assert chisquare_pvalue(counts, probs * n) > 1e-6, (counts, probs * n)
