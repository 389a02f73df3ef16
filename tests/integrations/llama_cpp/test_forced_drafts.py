"""A grammar's forced strings as drafts in skip-ahead generate() (structured/forced.py): with
Llama(logits_all=True) the tokenization of the string a grammar fixes is evaluated in the same
batch as the sampled token and each draft position is sampled and compared; outputs do not
change (greedy identical, T=1 exactly distributed), forward passes go down."""
import numpy as np
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import load, logits_after
from tests.helpers.stat_helpers import chisquare_pvalue

scipy_stats = pytest.importorskip("scipy.stats")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "visits": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2}},
    "required": ["name", "visits", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm_all(model_path):
    model = load(model_path, logits_all=True, n_ctx=128)  # logits_all keeps n_ctx rows of scores
    yield model
    model.close()


def test_greedy_is_unchanged_with_fewer_passes(llm_all, llm):
    prompt = llm_all.tokenize(b"Answer in JSON:")
    constraint = constrain(llm_all, json=SCHEMA, disable_any_whitespace=True)
    slow = generate(llm_all, prompt, constraint, max_tokens=80, skip_ahead=False)
    fast = generate(llm_all, prompt, constraint, max_tokens=80)
    assert fast.tokens == slow.tokens and fast.finish_reason == slow.finish_reason == "stop"
    assert fast.proposed_drafts > 0 and 0 < fast.accepted_drafts <= fast.proposed_drafts
    assert fast.forward_passes < slow.forward_passes
    assert fast.forward_passes + fast.forced_tokens + fast.accepted_drafts <= len(fast.tokens)
    # Without logits at every position there are no drafts: mask-forced tokens only, same output.
    plain = constrain(llm, json=SCHEMA, disable_any_whitespace=True)
    without = generate(llm, prompt, plain, max_tokens=80)
    assert without.tokens == fast.tokens and without.proposed_drafts == 0
    assert fast.forward_passes < without.forward_passes


GRAMMAR = 'root ::= "abcd" ("x" | "yz")'  # "abcd" in one token or several: drafts refused at times
TEMPERATURE = 2.0  # spreads the random model's choices over the tokenizations


def exact_distribution(llm, constraint, prompt, temperature):
    """P(token sequence) under the grammar-masked model at `temperature`, every complete output."""
    backend = constraint.info.grammar_backend()
    stops = set(constraint.info.stop_token_ids)
    bitmask = backend.allocate_token_bitmask(1)
    out = {}

    def walk(grammar, prefix, p):
        logits = logits_after(llm, prompt + prefix).astype(np.float64) / temperature
        backend.fill_bitmasks([grammar], bitmask, [0])
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: llm.n_vocab()].astype(bool)
        allowed = np.flatnonzero(bits)
        q = np.exp(logits[allowed] - logits[allowed].max())
        q /= q.sum()
        for token, prob in zip(allowed.tolist(), q.tolist()):
            if token in stops:
                out[tuple(prefix + [token])] = p * prob
                continue
            child = grammar.fork()
            assert child.accept_tokens([token])
            walk(child, prefix + [token], p * prob)

    walk(constraint.grammar.fresh(), [], 1.0)
    return out


def test_sampled_outputs_follow_the_exact_distribution(llm_all, llm):
    prompt = llm_all.tokenize(b"Say:")
    constraint = constrain(llm_all, grammar=GRAMMAR, mode="sampled")
    expected = exact_distribution(llm, constrain(llm, grammar=GRAMMAR, mode="sampled"), prompt, TEMPERATURE)
    n = 300
    counts = dict.fromkeys(expected, 0)
    proposed = accepted = 0
    for seed in range(n):
        result = generate(llm_all, prompt, constraint, max_tokens=12, temperature=TEMPERATURE, seed=seed)
        assert tuple(result.tokens) in counts, result.tokens
        counts[tuple(result.tokens)] += 1
        proposed, accepted = proposed + result.proposed_drafts, accepted + result.accepted_drafts
    assert 0 < accepted < proposed  # the model writes "abc" in other tokens at times
    keys = [k for k in expected if expected[k] * n >= 5]
    observed = [counts[k] for k in keys] + [sum(counts[k] for k in expected if k not in keys)]
    exp = [expected[k] * n for k in keys] + [sum(expected[k] for k in expected if k not in keys) * n]
    if exp[-1] == 0:
        observed, exp = observed[:-1], exp[:-1]
    assert chisquare_pvalue(observed, exp) > 1e-6, (observed, exp)
