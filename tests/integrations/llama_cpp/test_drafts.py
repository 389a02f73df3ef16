"""llama-cpp-python's prompt-lookup speculative decoding under a tree: drafts off the tree are
dropped before verification and outputs equal decoding without drafts."""
import pytest

from logitgate.integrations.llama_cpp import TreeDrafts, constrain
from tests.helpers.llama_helpers import CITIES, load

# The prompt repeats catalog items (so prompt lookup proposes them) and other text (drafts that
# leave the tree).
PROMPT = ("Visited: New York, then New Delhi, then Hong Kong, then Buenos Aires, then Los Angeles. "
          "Next stop:")
# Every item starts with a word of the prompt, so prompt lookup always finds a continuation.
ITEMS = [" New York", " New York City", " New Delhi", " New Delhi Station", " New Orleans", " Hong Kong",
         " Buenos Aires", " Buenos Aires Province", " Los Angeles", " Los Alamos"]


@pytest.fixture(scope="module")
def drafted(model_path):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = load(model_path, draft_model=TreeDrafts(LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=6)))
    yield model
    model.close()


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_drafts_change_nothing_but_speed(drafted, temperature):
    draft_model = drafted.draft_model
    constraint = constrain(drafted, strings=ITEMS, mode="sampled")
    runs = []
    for use_drafts in (True, False):
        drafted.draft_model = draft_model if use_drafts else None
        try:
            out = drafted.create_completion(
                PROMPT, max_tokens=24, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=7,
                logits_processor=constraint.processors(),
            )
        finally:
            drafted.draft_model = draft_model
        runs.append(out["choices"][0]["text"])
    assert runs[0] == runs[1]
    assert runs[0] in ITEMS


def test_off_tree_drafts_are_dropped(drafted):
    draft_model = drafted.draft_model
    before_proposed, before_dropped = draft_model.proposed, draft_model.dropped
    constraint = constrain(drafted, strings=ITEMS)
    out = drafted.create_completion(PROMPT, max_tokens=24, temperature=0.0, logits_processor=constraint.processors())
    text = out["choices"][0]["text"]
    assert text in ITEMS
    assert draft_model.proposed > before_proposed  # prompt lookup did propose
    assert draft_model.dropped > before_dropped  # and some proposals left the tree


def test_unwrapped_draft_model_is_refused(model_path):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = load(model_path, draft_model=LlamaPromptLookupDecoding())
    try:
        with pytest.raises(ValueError, match="TreeDrafts"):
            constrain(model, strings=CITIES).processors()
    finally:
        model.close()
