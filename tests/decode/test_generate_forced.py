"""The decode loop with a grammar's forced strings as drafts (structured/forced.py): outputs do not
change (greedy identical, sampled exactly distributed), target passes go down."""
import pytest
import torch

from logitgate.decode import Request, generate
from logitgate.sampling.params import SamplingParams
from logitgate.structured import StructuredOutputManager, StructuredOutputsParams
from tests.helpers.stat_helpers import chisquare_pvalue

xgr = pytest.importorskip("xgrammar")

# A vocabulary where fixed strings have several tokenizations ("abc" = abc | ab c | a bc | a b c).
PIECES = ["a", "b", "c", "ab", "bc", "abc", "x", "y", "<eos>", "<root>"]
V, EOS, ROOT = len(PIECES), 8, 9
REGEX = "abc(x|y)abc(x|yy)"


def encode(text: str) -> list[int]:
    """Longest match first: the 'canonical' tokenization the proposals use."""
    ids, at = [], 0
    while at < len(text):
        piece = max((p for p in PIECES[:8] if text.startswith(p, at)), key=len)
        ids.append(PIECES.index(piece))
        at += len(piece)
    return ids


class Bigram:
    def __init__(self, seed: int, scale: float = 2.0) -> None:
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


TARGET = Bigram(0)


def _manager() -> StructuredOutputManager:
    info = xgr.TokenizerInfo(PIECES[:8] + ["", ""], vocab_size=V, stop_token_ids=[EOS])
    return StructuredOutputManager(info, vocab_size=V, num_speculative_tokens=8, encode=encode)


def _params(temperature: float, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=16, seed=seed, structured_outputs=StructuredOutputsParams(regex=REGEX))


def exact_distribution() -> dict[tuple, float]:
    """P(token sequence) under the grammar-constrained bigram, for every complete output."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(PIECES[:8] + ["", ""], vocab_size=V, stop_token_ids=[EOS])).compile_regex(REGEX)
    bitmask = xgr.allocate_token_bitmask(1, V)
    out: dict[tuple, float] = {}

    def walk(matcher, last, prefix, p):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = [t for t in range(V) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        probs = torch.softmax(TARGET.table[last][allowed].double(), 0)
        for token, q in zip(allowed, probs.tolist()):
            if token == EOS:
                out[tuple(prefix + [EOS])] = p * q
                continue
            child = matcher.fork()
            assert child.accept_token(token)
            walk(child, token, prefix + [token], p * q)

    walk(xgr.GrammarMatcher(compiled), ROOT, [], 1.0)
    return out


def test_greedy_output_is_identical_with_fewer_target_passes():
    with _manager() as manager:
        requests = [Request([ROOT], _params(0.0))]
        plain = generate(TARGET, requests, eos_token_id=EOS, manager=manager, jump_forward=False)
        forced = generate(TARGET, requests, eos_token_id=EOS, manager=manager)
    assert forced.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.stats.proposed_forced_drafts == 0
    stats = forced.stats
    assert 0 < stats.accepted_forced_drafts <= stats.proposed_forced_drafts
    assert stats.target_forward_passes < plain.stats.target_forward_passes


@pytest.mark.parametrize("jump_forward", [True, False])
def test_sampled_outputs_follow_the_exact_distribution(jump_forward):
    expected = exact_distribution()
    with _manager() as manager:
        requests = [Request([ROOT], _params(1.0, seed=7000 + i)) for i in range(3000)]
        result = generate(TARGET, requests, eos_token_id=EOS, manager=manager, jump_forward=jump_forward)
    counts = dict.fromkeys(expected, 0)
    for out in result.outputs:
        assert tuple(out.token_ids) in counts, out.token_ids
        counts[tuple(out.token_ids)] += 1
    keys = [k for k in sorted(expected) if expected[k] * len(requests) >= 5]  # chi-square's rule of thumb
    observed = [counts[k] for k in keys] + [sum(counts[k] for k in expected if k not in keys)]
    exp = [expected[k] * len(requests) for k in keys] + [sum(expected[k] for k in expected if k not in keys) * len(requests)]
    assert chisquare_pvalue(observed, exp) > 1e-6
    if jump_forward:
        stats = result.stats
        assert 0 < stats.accepted_forced_drafts < stats.proposed_forced_drafts  # some tokenizations refused
        assert stats.sequence_steps < stats.tokens
