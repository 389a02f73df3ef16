"""speculative_generate on the embedded demo models: greedy output equals the target's own greedy
`generate` (plain, with a tree, with a grammar; draft model and n-gram drafts), sampled outputs
are valid tree paths, and the inputs / outputs follow Hugging Face's conventions."""
import json
import re

import pytest
import torch
from transformers import LogitsProcessorList

from logitgate import StructuredOutputsParams
from logitgate.integrations.transformers import GrammarLogitsProcessor, TreeLogitsProcessor, speculative_generate
from logitgate.models import EOS_ID, PAD_ID, demo_prompt, load_tree_config
from logitgate.models.demo import demo_hf_tokenizer
from logitgate.sampling import StructuredOutputsParams as SamplingStructuredOutputs
from tests.helpers.hf_helpers import assert_tree_path, generated, left_padded

HINTS = ["Krakow", "Tokyo", ""]


_GREEDY: dict = {}


def hf_greedy(model, prompt, processor=None, max_new_tokens=40):
    """The target's own greedy continuation of one prompt (no padding), up to and with its EOS;
    memoised per prompt and processor type (the tests share references)."""
    key = (id(model), tuple(prompt), type(processor).__name__, getattr(processor, "params", None), max_new_tokens)
    if key not in _GREEDY:
        ids = torch.tensor([prompt])
        processors = LogitsProcessorList([processor] if processor is not None else [])
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, logits_processor=processors)
        _GREEDY[key] = out[0, ids.shape[1] :].tolist()
    return _GREEDY[key]


@pytest.mark.parametrize("constraint", ["none", "tree"])
@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_greedy_equals_target_generate(models, tree, constraint, drafter):
    target, draft = models
    prompts = [demo_prompt(h) for h in HINTS]
    kwargs = {"tree": tree} if constraint == "tree" else {}
    if drafter == "ngram":
        kwargs.update(ngram=2)
        draft = None
    out = speculative_generate(target, draft, prompts, num_speculative_tokens=4, max_new_tokens=40, **kwargs)
    for prompt, tokens, reason in zip(prompts, out.token_ids, out.finish_reasons):
        expected = hf_greedy(target, prompt, TreeLogitsProcessor(tree) if constraint == "tree" else None)
        assert tokens == expected
        assert reason == "stop" and tokens[-1] == EOS_ID  # the EOS is also the tree's end token
    stats = out.stats
    assert stats.tokens == sum(len(t) for t in out.token_ids)
    if drafter == "draft-model":  # most drafts accepted: far fewer target passes than tokens
        assert stats.draft_forward_passes > 0 and stats.acceptance_rate > 0.5
        assert stats.target_forward_passes < max(len(t) for t in out.token_ids) / 2
    else:
        assert stats.proposed_drafts > 0 and stats.draft_forward_passes == 0
    if constraint == "tree":
        assert stats.forced_tokens > 0


def test_greedy_with_a_grammar_equals_target_generate(models, tok, tokenizer_info):
    target, draft = models
    schema = {"type": "object", "properties": {"zone": {"enum": ["Europe/Berlin", "Asia/Tokyo", "Africa/Cairo"]}}, "required": ["zone"]}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompts = [demo_prompt("Cairo"), demo_prompt("Tokyo")]
    out = speculative_generate(target, draft, prompts, structured_outputs=params, tokenizer_info=tokenizer_info, max_new_tokens=40)
    for prompt, tokens in zip(prompts, out.token_ids):
        expected = hf_greedy(target, prompt, GrammarLogitsProcessor(tokenizer_info, params))
        assert tokens == expected
        assert json.loads(tok.decode(tokens))["zone"] in schema["properties"]["zone"]["enum"]
    # vLLM-style SamplingParams field class works the same.
    again = speculative_generate(
        target, draft, prompts, structured_outputs=SamplingStructuredOutputs(json=schema, disable_any_whitespace=True),
        tokenizer_info=tokenizer_info, max_new_tokens=40,
    )
    assert again.token_ids == out.token_ids


def test_sampled_outputs_are_tree_paths(models, tok, tree, catalog):
    target, draft = models
    prompts = [demo_prompt(h) for h in HINTS]
    kwargs = dict(tree=load_tree_config(), temperature=1.2, top_k=50, top_p=0.95, seed=7, num_return_sequences=4, max_new_tokens=40)
    out = speculative_generate(target, draft, prompts, **kwargs)
    assert len(out.token_ids) == len(prompts) * 4
    for tokens in out.token_ids:
        assert tokens[-1] == EOS_ID
        assert_tree_path(tree, tokens[:-1])
        assert tok.decode(tokens) in catalog
    assert len({tuple(t) for t in out.token_ids[8:]}) > 1  # the empty hint spreads out
    assert speculative_generate(target, draft, prompts, **kwargs).token_ids == out.token_ids  # seeded


def test_sequences_follow_hf_layout(models, tree):
    """`sequences` is what `model.generate` returns: the inputs as given (left padding kept) and
    the generated tokens, right-padded with the pad token after each row's EOS."""
    target, draft = models
    prompts = [demo_prompt("Tokyo"), demo_prompt("Paris")]  # equal lengths: HF batches them unpadded
    ids = torch.tensor(prompts)
    expected = target.generate(ids, do_sample=False, max_new_tokens=40, logits_processor=LogitsProcessorList([TreeLogitsProcessor(tree)]))
    out = speculative_generate(target, draft, ids, tree=tree)
    assert torch.equal(out.sequences, expected)
    # Left-padded tensor inputs, with the attention mask or with leading pad tokens only.
    padded, mask = left_padded([demo_prompt("Oslo"), demo_prompt("Ho Chi Minh")])
    with_mask = speculative_generate(target, draft, padded, attention_mask=mask, tree=tree)
    assert torch.equal(with_mask.sequences[:, : padded.shape[1]], padded)
    inferred = speculative_generate(target, draft, padded, tree=tree)
    assert torch.equal(inferred.sequences, with_mask.sequences)
    for row, prompt, tokens in zip(with_mask.sequences, [demo_prompt("Oslo"), demo_prompt("Ho Chi Minh")], with_mask.token_ids):
        assert generated(row, padded.shape[1]) + [EOS_ID] == tokens == hf_greedy(target, prompt, TreeLogitsProcessor(tree))


def test_max_new_tokens_and_defaults(models, tok):
    target, draft = models
    out = speculative_generate(target, draft, demo_prompt("Buenos Aires"), max_new_tokens=5)
    assert out.finish_reasons == ["length"] and len(out.token_ids[0]) == 5
    assert out.sequences.shape == (1, len(demo_prompt("Buenos Aires")) + 5)
    # eos_token_id / pad_token_id default from the generation config; a list of EOS ids is taken.
    out = speculative_generate(target, draft, [demo_prompt("UTC")], eos_token_id=[ord("/"), EOS_ID])
    assert out.finish_reasons == ["stop"] and tok.decode(out.token_ids[0]).endswith("/")


def test_bad_arguments(models, tree, tokenizer_info):
    target, draft = models
    prompt = [demo_prompt("Oslo")]
    with pytest.raises(ValueError, match="tree or structured_outputs"):
        speculative_generate(target, draft, prompt, tree=tree, structured_outputs=StructuredOutputsParams(regex="a"), tokenizer_info=tokenizer_info)
    with pytest.raises(ValueError, match="needs sampling"):
        speculative_generate(target, draft, prompt, num_return_sequences=2)
    with pytest.raises(ValueError, match="row 0 is empty"):
        speculative_generate(target, draft, torch.tensor([[PAD_ID, PAD_ID]]))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        speculative_generate(target, draft, torch.tensor(prompt), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="give draft_model or ngram"):
        speculative_generate(target, draft, prompt, ngram=2)


def test_grammar_output_matches_regex_when_sampling(models, tok, tokenizer_info):
    target, draft = models
    zone = r"(Europe|Asia)/[A-Z][a-z]{1,10}"
    out = speculative_generate(
        target, draft, [demo_prompt(""), demo_prompt("Berlin")], structured_outputs=StructuredOutputsParams(regex=zone),
        tokenizer_info=tokenizer_info, temperature=1.0, seed=3, num_return_sequences=3, max_new_tokens=40,
    )
    for tokens in out.token_ids:
        assert tokens[-1] == EOS_ID and re.fullmatch(zone, tok.decode(tokens))


def test_a_grammars_forced_strings_are_drafted_and_verified(models, tokenizer_info):
    """The strings a grammar fixes (`{"zone":"`, the rest of a zone once it is unique) are drafted:
    greedy output unchanged, fewer target passes than without them. On the demo's byte vocabulary
    a fixed string has one tokenization, so every draft of it is accepted (refused tokenizations,
    on a vocabulary with merges: tests/decode/test_generate_forced.py)."""
    target, _ = models
    schema = {"type": "object", "properties": {"zone": {"enum": ["Europe/Berlin", "Asia/Tokyo", "Africa/Cairo"]}}, "required": ["zone"]}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompts = [demo_prompt("Cairo"), demo_prompt("Tokyo")]
    kwargs = dict(structured_outputs=params, tokenizer_info=tokenizer_info, max_new_tokens=40, tokenizer=demo_hf_tokenizer())
    forced = speculative_generate(target, None, prompts, **kwargs)
    plain = speculative_generate(target, None, prompts, jump_forward=False, **kwargs)
    for prompt, tokens in zip(prompts, forced.token_ids):
        assert tokens == hf_greedy(target, prompt, GrammarLogitsProcessor(tokenizer_info, params))
    assert forced.token_ids == plain.token_ids
    stats = forced.stats
    assert stats.forced_tokens + stats.accepted_forced_drafts > 20 and stats.accepted_forced_drafts <= stats.proposed_forced_drafts
    assert stats.sequence_steps < plain.stats.sequence_steps / 4 and plain.stats.sequence_steps == plain.stats.tokens
