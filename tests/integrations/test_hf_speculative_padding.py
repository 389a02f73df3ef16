"""speculative_generate with models whose vocabularies differ only by embedding-row padding: accepted
when the tokenizers agree on the real tokens, and padding ids are never drafted nor sampled."""
import copy
import json

import pytest
import torch
from transformers import LogitsProcessorList, PreTrainedTokenizerFast

from logitgate.integrations.transformers import TreeLogitsProcessor, speculative_generate
from logitgate.models import VOCAB_SIZE, demo_hf_tokenizer, demo_prompt
from logitgate.models.hf_byte_tokenizer import build_hf_byte_tokenizer

PADDED = 320  # 260 real tokens padded to a multiple of 64, as real checkpoints pad their embeddings
HINTS = ["Krakow", "Tokyo"]


@pytest.fixture(scope="module")
def hf_tok():
    return demo_hf_tokenizer()


def resized(model, size):
    """A copy of `model` whose embedding (and tied LM head) has `size` rows, as HF resizes them."""
    twin = copy.deepcopy(model)
    twin.resize_token_embeddings(size, mean_resizing=False)
    assert twin.config.vocab_size == size
    return twin


class PaddingWins(torch.nn.Module):
    """A model whose padding ids (past the real tokens) get logits far above every real token: if
    padding were not masked, every draft / sample from it would be a padding id."""

    def __init__(self, model, size):
        super().__init__()
        self.model = resized(model, size)
        self.config = self.model.config
        self.generation_config = self.model.generation_config

    def forward(self, input_ids, use_cache=False):
        out = self.model(input_ids=input_ids, use_cache=use_cache)
        out.logits[..., VOCAB_SIZE:] = out.logits.max() + 30.0
        return out


def own_greedy(model, tree, hint):
    prompt = torch.tensor([demo_prompt(hint)])
    out = model.generate(prompt, do_sample=False, max_new_tokens=40,
                         logits_processor=LogitsProcessorList([TreeLogitsProcessor(tree)]))
    return out[0, prompt.shape[1]:].tolist()


def test_padded_draft_is_accepted_with_the_tokenizer(models, tree, hf_tok):
    target, draft = models
    prompts = [demo_prompt(h) for h in HINTS]
    plain = speculative_generate(target, draft, prompts, tree=tree, jump_forward=False)
    padded = speculative_generate(target, resized(draft, PADDED), prompts, tree=tree, jump_forward=False, tokenizer=hf_tok)
    assert padded.token_ids == plain.token_ids == [own_greedy(target, tree, h) for h in HINTS]
    assert padded.stats.accepted_drafts == plain.stats.accepted_drafts > 0  # the same drafts as unpadded


def test_padding_is_never_drafted(models, tree, hf_tok):
    target, draft = models
    prompts = [demo_prompt(h) for h in HINTS]
    plain = speculative_generate(target, draft, prompts, tree=tree, jump_forward=False)
    # Both padded (the target to 320, the draft to 384): the draft's columns 260..319 survive the cut
    # to the target's width, so only the mask keeps them out.
    padded_target, padded_draft = resized(target, PADDED), PaddingWins(draft, PADDED + 64)
    greedy = speculative_generate(padded_target, padded_draft, prompts, tree=tree, jump_forward=False,
                                  tokenizer=hf_tok, draft_tokenizer=demo_hf_tokenizer())
    # Unmasked, every draft would be a padding id and rejected; masked, the draft proposes what the
    # unpadded draft proposes.
    assert greedy.token_ids == plain.token_ids
    assert greedy.stats.accepted_drafts == plain.stats.accepted_drafts > 0
    sampled = speculative_generate(padded_target, padded_draft, prompts, temperature=1.0, seed=0,
                                   num_return_sequences=4, max_new_tokens=24, tokenizer=hf_tok)
    assert sampled.stats.accepted_drafts > 0
    assert all(0 <= t < VOCAB_SIZE for tokens in sampled.token_ids for t in tokens)


def test_padding_is_never_sampled_from_the_target(models, tree, hf_tok):
    target, draft = models
    padded_target = PaddingWins(target, PADDED)
    prompts = [demo_prompt(h) for h in HINTS]
    greedy = speculative_generate(padded_target, draft, prompts, tokenizer=hf_tok, max_new_tokens=40)
    free = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40)[0, len(p):].tolist() for p in prompts]
    assert greedy.token_ids == free  # the real tokens' argmax: the unpadded target's own greedy output
    sampled = speculative_generate(padded_target, resized(draft, 384), prompts, temperature=1.0, seed=1,
                                   num_return_sequences=4, max_new_tokens=24, tokenizer=hf_tok)
    assert sampled.sequences.shape[0] == 8
    assert all(0 <= t < VOCAB_SIZE for tokens in sampled.token_ids for t in tokens)


def _swapped_specials_tokenizer():
    """The demo tokenizer with <eos> and <pad> trading ids: same size, different tokens."""
    data = json.loads(build_hf_byte_tokenizer().backend_tokenizer.to_str())
    names = {t["id"]: t["content"] for t in data["added_tokens"]}
    for token in data["added_tokens"]:
        token["content"] = {257: names[258], 258: names[257]}.get(token["id"], token["content"])
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))


def test_vocabulary_mismatches_are_refused_with_the_reason(models, hf_tok):
    target, draft = models
    prompts = [demo_prompt("Tokyo")]
    with pytest.raises(ValueError, match=r"draft model's vocab_size 320 differs from the target's 260; .*pass tokenizer="):
        speculative_generate(target, resized(draft, PADDED), prompts)
    with pytest.raises(ValueError, match=r"disagree on token id 257: '<eos>' \(target\) vs '<pad>' \(draft\)"):
        speculative_generate(target, resized(draft, PADDED), prompts, tokenizer=hf_tok,
                             draft_tokenizer=_swapped_specials_tokenizer())
    with pytest.raises(ValueError, match="the tokenizer has 260 tokens but the draft model's vocab_size is 200"):
        speculative_generate(target, resized(draft, 200), prompts, tokenizer=hf_tok)
    with pytest.raises(ValueError, match="draft_tokenizer needs tokenizer"):
        speculative_generate(target, draft, prompts, draft_tokenizer=hf_tok)
