"""sample_first's redraw (integrations/vllm/sample_first/redraw.py), without vLLM: a rejected row
ends as the masked argmax (greedy, ties to the lowest id) or as an exact draw from its distribution
restricted to what its grammar allows (chi-square, alpha 1e-6), through both ways it is settled
(the best keys of one exponential race, the filled mask), and what a row with nothing allowed gets."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate.integrations.vllm.sample_first import redraw
from tests.helpers.stat_helpers import chisquare_pvalue


class AllowedSet:
    """A grammar of vLLM's interface that allows a fixed set of tokens at every step (its
    validate_tokens is its mask, as xgrammar's)."""

    validates_as_mask = True

    def __init__(self, allowed):
        self.allowed = set(allowed)
        self.fills = self.checks = 0

    def validate_tokens(self, tokens):
        self.checks += 1
        out = []
        for token in tokens:
            if token not in self.allowed:
                break
            out.append(token)
        return out

    def fill_bitmask(self, bitmask, index):
        self.fills += 1
        words = [0] * bitmask.shape[1]
        for token in self.allowed:
            words[token // 32] |= 1 << (token % 32)
        bitmask[index] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def masked(logits, allowed):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    return logits.masked_fill(~keep, float("-inf"))


def choose(logits, grammars, temperatures, rejected, candidates=None, generator=None):
    width = math.ceil(logits.shape[1] / 32)
    return redraw.choose_again(logits.clone(), grammars, temperatures, rejected, width, candidates, generator)


# ---- greedy rows: the masked argmax, ties to the lowest id ----


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_greedy_rows_end_as_the_masked_argmax(data):
    vocab = data.draw(st.integers(2, 90))
    values = data.draw(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 3.0, float("-inf")]), min_size=vocab,
                                max_size=vocab))
    allowed = data.draw(st.sets(st.integers(0, vocab - 1), min_size=1))
    candidates = data.draw(st.integers(1, 40))
    logits = torch.tensor([values])
    first = int(logits[0].argmax())
    if first in allowed:
        return  # an accepted first draw is never redrawn
    grammar = AllowedSet(allowed)
    [(token, how)] = choose(logits, [grammar], [0.0], [first], candidates)
    expected = int(masked(logits[0], allowed).argmax())  # torch: the first maximum; all -inf -> 0
    assert token == expected
    assert how == ("filled" if grammar.fills else "redrawn")


def test_a_tie_at_the_last_key_looked_at_is_left_to_the_mask():
    logits = torch.zeros(1, 64)
    logits[0, 0] = 5.0  # rejected first draw; every other token ties at 0
    grammar = AllowedSet({7, 40})
    [(token, how)] = choose(logits, [grammar], [0.0], [0], candidates=4)
    assert (token, how) == (7, "filled")  # the lowest tied id, found through the mask


def test_the_best_allowed_key_is_found_without_a_fill():
    logits = torch.arange(64, dtype=torch.float32).flip(0).unsqueeze(0)  # token 0 best, 63 worst
    grammar = AllowedSet({5, 6})
    assert choose(logits, [grammar], [0.0], [0]) == [(5, "redrawn")]
    assert grammar.fills == 0 and grammar.checks == 5  # tokens 1..5: the rejected first draw is not checked again


def test_candidates_past_the_limit_fill_the_mask():
    logits = torch.arange(64, dtype=torch.float32).flip(0).unsqueeze(0)
    grammar = AllowedSet({40})
    assert choose(logits, [grammar], [0.0], [0], candidates=4) == [(40, "filled")]
    assert grammar.fills == 1


# ---- sampled rows: exact draws from the masked distribution ----


@pytest.mark.parametrize("candidates, peaked", [(32, False), (1, False), (32, True)])
def test_sampled_rows_follow_the_masked_distribution(candidates, peaked):
    """candidates 1: most redraws go through the filled mask. peaked: nearly all the mass sits on
    two disallowed tokens; the race must still find the allowed ones in their proportions."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows, rounds, temperature = 40, 32, 250, 0.8
    row = torch.randn(vocab, generator=generator) * 1.5
    row[3] = 4.0
    if peaked:
        row[3], row[4] = 40.0, 25.0
    allowed = {0, 5, 6, 11, 17, 22, 23, 30, 38}
    counts = dict.fromkeys(range(vocab), 0)
    hows = {"redrawn": 0, "filled": 0}
    for _ in range(rounds):
        grammars = [AllowedSet(allowed) for _ in range(rows)]
        for token, how in choose(row.repeat(rows, 1), grammars, [temperature] * rows, [3] * rows, candidates, generator):
            counts[token] += 1
            hows[how] += 1
    assert {t for t, c in counts.items() if c} <= allowed
    probs = masked(row / temperature, allowed).double().softmax(0)
    tokens = sorted(allowed)
    observed = [counts[t] for t in tokens]
    expected = [float(probs[t]) * rows * rounds for t in tokens]
    assert chisquare_pvalue(observed, expected) > 1e-6, list(zip(observed, expected))
    assert hows["filled"] > 0 if candidates == 1 else hows["redrawn"] == rows * rounds


def test_a_rejected_first_draw_then_the_race_gives_the_restricted_distribution():
    """The whole path: a first draw from p kept when allowed, else the race. P(t) = p(t) / p(A)."""
    generator = torch.Generator().manual_seed(1)
    vocab, n = 12, 40000
    logits = torch.randn(vocab, generator=generator)
    allowed = {1, 4, 9}
    probs = logits.softmax(0)
    firsts = torch.multinomial(probs, n, replacement=True, generator=generator).tolist()
    counts = dict.fromkeys(allowed, 0)
    rejected = [t for t in firsts if t not in allowed]
    for t in firsts:
        if t in allowed:
            counts[t] += 1
    grammars = [AllowedSet(allowed) for _ in rejected]
    for token, _ in choose(logits.repeat(len(rejected), 1), grammars, [1.0] * len(rejected), rejected, None, generator):
        counts[token] += 1
    mass = float(probs[sorted(allowed)].sum())
    expected = [float(probs[t]) / mass * n for t in sorted(allowed)]
    assert chisquare_pvalue([counts[t] for t in sorted(allowed)], expected) > 1e-6


def test_mixed_greedy_and_sampled_rows_in_one_call():
    logits = torch.randn(3, 64)
    grammars = [AllowedSet({7, 9}), AllowedSet({1}), AllowedSet({2, 60})]
    firsts = [int(logits[i].argmax()) for i in range(3)]
    firsts = [t if t not in g.allowed else (t + 1) % 64 for t, g in zip(firsts, grammars)]
    chosen = choose(logits, grammars, [0.0, 1.0, 0.0], firsts)
    assert chosen[0][0] == int(masked(logits[0], {7, 9}).argmax())
    assert chosen[1][0] == 1
    assert chosen[2][0] == int(masked(logits[2], {2, 60}).argmax())


# ---- rows where nothing allowed survives the logits operations ----


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("candidates", [1, 32])
def test_a_row_whose_allowed_tokens_are_all_banned_gets_token_0(temperature, candidates):
    """Issue 22.5: allowed_token_ids left -inf on every token the grammar allows. vLLM's masked row
    is all -inf and its sampler returns token 0."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, 0], logits[0, 1] = 1.0, 2.0
    for _ in range(20):
        assert choose(logits, [AllowedSet({10, 11, 40})], [temperature], [1], candidates)[0][0] == 0


def test_race_keys_keep_minus_infinity_and_leave_greedy_rows():
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, float("-inf"), 0.5]])
    keys = redraw.race_keys(logits.clone(), [0.0, 0.7], torch.Generator().manual_seed(3))
    assert torch.equal(keys[0], logits[0])
    assert keys[1, 1] == float("-inf") and torch.isfinite(keys[1, [0, 2]]).all()


class StoppedMatcher(AllowedSet):
    """llguidance's matcher once its grammar is complete (vLLM's GuidanceGrammar): validate_tokens
    refuses every token, the stop token included, while its mask allows the stop token alone."""

    def validate_tokens(self, tokens):
        self.checks += 1
        return []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("candidates", [1, 32])
def test_the_mask_decides_where_validate_tokens_refuses_what_it_allows(temperature, candidates):
    """The served benchmark's guidance rows drew the stop token at the end of their JSON, the stopped
    matcher refused it, and the row ended as token 0 ("!"): the refused first token must stay in the
    race that the filled mask settles."""
    eos = 50
    logits = torch.zeros(1, 64)
    logits[0, eos] = 5.0  # the first draw (greedy: certainly) is the stop token
    for _ in range(20):
        grammar = StoppedMatcher({eos})
        assert choose(logits, [grammar], [temperature], [eos], candidates) == [(eos, "filled")]
        assert grammar.fills == 1


# ---- rows checked by their mask (a grammar whose validate_tokens is not its mask: llguidance's) ----


class Lenient(AllowedSet):
    """validate_tokens accepts every token; only the mask says what is allowed (as llguidance's
    accepts non-canonical tokenizations its mask excludes)."""

    def validate_tokens(self, tokens):
        self.checks += 1
        return list(tokens)


def mask_of(allowed, vocab):
    bitmask = torch.zeros(1, math.ceil(vocab / 32), dtype=torch.int32)
    AllowedSet(allowed).fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_which_grammars_stand_for_their_mask_and_the_bit_of_a_token():
    from types import SimpleNamespace

    assert redraw.VALIDATES_AS_MASK == {"XgrammarGrammar"}
    assert redraw.validates_as_its_mask(type("XgrammarGrammar", (), {})())
    assert not redraw.validates_as_its_mask(type("GuidanceGrammar", (), {})())
    assert not redraw.validates_as_its_mask(SimpleNamespace())  # unknown: checked by its mask
    assert redraw.validates_as_its_mask(AllowedSet({1}))
    mask = mask_of({0, 31, 33, 63}, 64)
    assert [t for t in range(70) if redraw.allows(mask, t)] == [0, 31, 33, 63]


@pytest.mark.parametrize("temperature, candidates", [(0.0, 32), (0.8, 32), (0.8, 1)])
def test_a_row_with_its_mask_is_settled_by_the_mask_alone(temperature, candidates):
    """Issue 36.2: the row's filled mask is the only judge (validate_tokens, which would accept the
    best key, is never asked and nothing is filled again); sampled rows follow the masked
    distribution (chi-square, alpha 1e-6)."""
    generator = torch.Generator().manual_seed(2)
    vocab, rows, rounds = 40, 32, 150
    row = torch.randn(vocab, generator=generator)
    row[3] = 6.0  # the first draw, refused by the mask
    allowed = {0, 5, 11, 17, 30}
    mask = mask_of(allowed, vocab)
    counts = dict.fromkeys(range(vocab), 0)
    for _ in range(rounds if temperature else 1):
        grammars = [Lenient(allowed) for _ in range(rows)]
        width = math.ceil(vocab / 32)
        chosen = redraw.choose_again(row.repeat(rows, 1), grammars, [temperature] * rows, [3] * rows, width, candidates,
                                     generator, masks=[mask] * rows)
        assert {how for _, how in chosen} == {"filled"}
        assert sum(g.checks + g.fills for g in grammars) == 0
        for token, _ in chosen:
            counts[token] += 1
    if not temperature:
        assert counts[int(masked(row, allowed).argmax())] == rows
        return
    assert {t for t, c in counts.items() if c} <= allowed
    probs = masked(row / temperature, allowed).double().softmax(0)
    tokens = sorted(allowed)
    expected = [float(probs[t]) * rows * rounds for t in tokens]
    assert chisquare_pvalue([counts[t] for t in tokens], expected) > 1e-6


def test_rows_with_and_without_their_mask_in_one_call():
    logits = torch.randn(2, 64)
    logits[:, 3] = 9.0
    grammars = [Lenient({7, 9}), AllowedSet({2, 60})]
    chosen = redraw.choose_again(logits.clone(), grammars, [0.0, 0.0], [3, 3], 2, masks=[mask_of({7, 9}, 64), None])
    assert chosen[0] == (int(masked(logits[0], {7, 9}).argmax()), "filled") and grammars[0].checks == 0
    assert chosen[1][0] == int(masked(logits[1], {2, 60}).argmax()) and grammars[1].checks > 0
