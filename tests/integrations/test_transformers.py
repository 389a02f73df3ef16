"""TreeLogitsProcessor and GrammarLogitsProcessor inside Hugging Face `model.generate` with the
embedded demo models: greedy, sampling, beam search, beam sampling and num_return_sequences."""
import json
import re

import pytest
import torch
from transformers import LogitsProcessorList

from logitgate import StructuredOutputsParams, TreeDFA
from logitgate.integrations.transformers import GrammarLogitsProcessor, TreeLogitsProcessor
from logitgate.models import EOS_ID, PAD_ID, ROOT_ID, VOCAB_SIZE, demo_prompt, load_tree_config
from tests.helpers.hf_helpers import assert_tree_path, generated, left_padded

MAX_NEW = 40  # the longest catalog name is 32 bytes

# (generate keyword arguments, sequences per prompt)
DECODING = {
    "greedy": ({"do_sample": False}, 1),
    "sampling": ({"do_sample": True, "temperature": 1.3, "top_k": 40, "top_p": 0.95, "num_return_sequences": 4}, 4),
    "beams-n": ({"do_sample": False, "num_beams": 4, "num_return_sequences": 3}, 3),
    "beam-sampling": ({"do_sample": True, "num_beams": 3, "num_return_sequences": 2}, 2),
}


def run(model, prompts, processor, **kwargs):
    ids, mask = left_padded(prompts)
    torch.manual_seed(0)
    kwargs.setdefault("max_new_tokens", MAX_NEW)
    out = model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([processor]), **kwargs)
    return out, ids.shape[1]


# ---------------------------------------------------------------------------------------------
# TreeLogitsProcessor


@pytest.mark.parametrize("mode", list(DECODING))
def test_tree_every_sequence_is_a_catalog_path(models, tok, tree, catalog, mode):
    kwargs, per_prompt = DECODING[mode]
    hints = ["Krakow", ""]  # different lengths: left padding; "" lets sampling spread out
    out, width = run(models[0], [demo_prompt(h) for h in hints], TreeLogitsProcessor(tree), **kwargs)
    assert out.shape[0] == len(hints) * per_prompt
    names = []
    for row in out:
        tokens = generated(row, width)
        assert_tree_path(tree, tokens)
        names.append(tok.decode(tokens))
        assert names[-1] in catalog
    if mode == "beams-n":  # beams of one prompt are distinct hypotheses
        assert all(len(set(names[i : i + per_prompt])) == per_prompt for i in range(0, len(names), per_prompt))


def test_tree_constraint_changes_the_output(models, tok, tree, catalog):
    """Unconstrained, the target invents a name for an unknown city; constrained it picks one."""
    prompt = torch.tensor([demo_prompt("Krakow")])
    free = models[0].generate(prompt, do_sample=False, max_new_tokens=MAX_NEW)
    assert tok.decode(generated(free[0], prompt.shape[1])) not in catalog
    out, width = run(models[0], [demo_prompt("Krakow")], TreeLogitsProcessor(tree), do_sample=False)
    assert tok.decode(generated(out[0], width)) in catalog


def test_tree_finished_rows_get_padding(models, tree):
    """Rows that end early are padded by HF while others go on; the padded rows stay finished
    (only the end token allowed), so no row is ever fully masked."""
    processor = TreeLogitsProcessor(tree)
    out, width = run(models[0], [demo_prompt("UTC"), demo_prompt("Buenos Aires")], processor, do_sample=True)
    lengths = [len(generated(row, width)) for row in out]
    assert min(lengths) < max(lengths)  # the shorter row was padded after its EOS, sampling went on


def test_tree_states_follow_beam_reordering(tree):
    """Rows are derived from input_ids alone: permuting and duplicating rows (what beam search does)
    permutes and duplicates the states."""
    processor = TreeLogitsProcessor(tree, prompt_length=1)
    names = [tok_bytes("Europe/Berlin"), tok_bytes("Asia/Tokyo"), tok_bytes("Europe/Belgrade")]
    rows = torch.tensor([[ROOT_ID, *n[:8]] for n in names])
    scores = processor(rows, torch.zeros(3, VOCAB_SIZE))
    for order in ([2, 0, 1], [1, 1, 0]):
        again = processor(rows[order], torch.zeros(3, VOCAB_SIZE))
        assert torch.equal(again, scores[order])
    for i, n in enumerate(names):
        allowed = torch.isfinite(scores[i]).nonzero().flatten().tolist()
        assert allowed == tree.allowed(tree.walk(n[:8]))


def tok_bytes(text: str) -> list[int]:
    return list(text.encode())


def test_tree_processor_reused_across_generations(models, tree):
    """One processor in a loop over prompts of different lengths gives what a fresh one gives."""
    shared = TreeLogitsProcessor(tree)
    for hint in ["Buenos Aires", "Oslo", "Ho Chi Minh"]:
        fresh, width = run(models[0], [demo_prompt(hint)], TreeLogitsProcessor(tree), do_sample=False, max_new_tokens=12)
        reused, _ = run(models[0], [demo_prompt(hint)], shared, do_sample=False, max_new_tokens=12)
        assert torch.equal(fresh, reused)


def test_tree_processor_reset(models, tree):
    """A new prompt exactly one column longer than the last input looks like the next step of the
    last generation (the tree processor never syncs to compare prompts); reset() says otherwise."""
    shared = TreeLogitsProcessor(tree)
    first, width = run(models[0], [demo_prompt("Tokyo")], shared, do_sample=False, max_new_tokens=3)
    prompt = demo_prompt("Shanghai")
    assert len(prompt) == first.shape[1]  # the last call saw width + 2 columns
    fresh, _ = run(models[0], [prompt], TreeLogitsProcessor(tree), do_sample=False)
    shared.reset()
    reused, _ = run(models[0], [prompt], shared, do_sample=False)
    assert torch.equal(fresh, reused)


def test_tree_processor_padded_vocab_and_bad_trees(tree):
    processor = TreeLogitsProcessor(tree, prompt_length=1)
    rows = torch.tensor([[ROOT_ID]])
    scores = processor(rows, torch.zeros(1, VOCAB_SIZE + 40))  # an LM head padded past the vocabulary
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == tree.allowed(tree.root)
    with pytest.raises(ValueError, match="token id 257 but the scores have only 200 columns"):
        processor(rows, torch.zeros(1, 200))
    with pytest.raises(ValueError, match="same rows"):
        processor(rows, torch.zeros(2, VOCAB_SIZE))
    with pytest.raises(ValueError, match="must be a TreeDFA"):
        TreeLogitsProcessor(load_tree_config())
    with pytest.raises(ValueError, match="prompt_length"):
        TreeLogitsProcessor(tree, prompt_length=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tree_device", ["cpu", "cuda"])
def test_tree_processor_on_cuda(models, tree_device, catalog, tok):
    model = models[0].to("cuda")
    try:
        cuda_tree = TreeDFA.from_prefix_dict(load_tree_config(), device=tree_device)
        prompts = [demo_prompt("Krakow"), demo_prompt("")]
        ids, mask = left_padded(prompts)
        out = model.generate(
            ids.cuda(), attention_mask=mask.cuda(), do_sample=True, num_return_sequences=2, max_new_tokens=MAX_NEW,
            logits_processor=LogitsProcessorList([TreeLogitsProcessor(cuda_tree)]),
        )
        for row in out.cpu():
            assert tok.decode(generated(row, ids.shape[1])) in catalog
    finally:
        models[0].to("cpu")


# ---------------------------------------------------------------------------------------------
# GrammarLogitsProcessor

ZONE = r"(Europe|Asia|America)/[A-Z][a-z]{1,10}"
SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": f"^{ZONE}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}


def check_json(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"zone"} and re.fullmatch(ZONE, value["zone"]), text


@pytest.mark.parametrize(
    "kind, mode", [("json", mode) for mode in DECODING] + [("regex", "sampling"), ("regex", "beams-n")]
)
def test_grammar_every_sequence_matches(models, tok, tokenizer_info, mode, kind):
    kwargs, per_prompt = DECODING[mode]
    if kind == "json":
        processor = GrammarLogitsProcessor(tokenizer_info, json=SCHEMA, disable_any_whitespace=True)
        check = check_json
    else:
        processor = GrammarLogitsProcessor(tokenizer_info, regex=ZONE)

        def check(text):
            assert re.fullmatch(ZONE, text), text

    out, width = run(models[0], [demo_prompt("Berlin"), demo_prompt("")], processor, **kwargs)
    assert out.shape[0] == 2 * per_prompt
    for row in out:
        check(tok.decode(generated(row, width)))


def test_grammar_choice_and_ebnf(models, tok, tokenizer_info):
    choices = ["Europe/Berlin", "Asia/Tokyo", "America/New_York"]
    processor = GrammarLogitsProcessor(tokenizer_info, StructuredOutputsParams(choice=choices))
    out, width = run(models[0], [demo_prompt("Tokyo"), demo_prompt("Berlin")], processor, num_beams=3, num_return_sequences=3)
    texts = [tok.decode(generated(row, width)) for row in out]
    assert set(texts) == set(choices)  # three beams per prompt: every choice once
    assert texts[0] == "Asia/Tokyo" and texts[3] == "Europe/Berlin"  # the best beam is the model's pick
    ebnf = 'root ::= region "/" [A-Z] [a-z_]+\nregion ::= "Europe" | "Africa"'
    processor = GrammarLogitsProcessor(tokenizer_info, grammar=ebnf)
    out, width = run(models[0], [demo_prompt("Cairo"), demo_prompt("")], processor, do_sample=True, num_return_sequences=3)
    for row in out:
        assert re.fullmatch(r"(Europe|Africa)/[A-Z][a-z_]+", tok.decode(generated(row, width)))


def test_grammar_prefix_dict_kind(models, tok, tree, catalog):
    """Tree kinds go through the same processor (TreeGrammar on the host); same answers as the
    device TreeLogitsProcessor."""
    processor = GrammarLogitsProcessor(vocab_size=VOCAB_SIZE, prefix_dict=load_tree_config(), stop_token_ids=[EOS_ID])
    prompts = [demo_prompt("Krakow"), demo_prompt("Lima")]
    out, width = run(models[0], prompts, processor, num_beams=3, num_return_sequences=2)
    expected, _ = run(models[0], prompts, TreeLogitsProcessor(tree), num_beams=3, num_return_sequences=2)
    assert torch.equal(out, expected)


def reference_mask(tokenizer_info, generated_rows, **constraint):
    """Each row's allowed set from a matcher replayed from scratch (no sharing between rows)."""
    masks = []
    for tokens in generated_rows:
        fresh = GrammarLogitsProcessor(tokenizer_info, prompt_length=0, **constraint)
        masks.append(fresh(torch.tensor([tokens], dtype=torch.int64).reshape(1, -1), torch.zeros(1, VOCAB_SIZE))[0])
    return torch.stack(masks)


def test_grammar_rows_follow_beam_reordering(tokenizer_info):
    """Beam search reorders, duplicates and drops rows between calls; every row's mask equals a
    from-scratch replay of its own tokens, however the rows were derived (fork, move, replay)."""
    processor = GrammarLogitsProcessor(tokenizer_info, regex=ZONE, prompt_length=1)
    steps = [
        [[ROOT_ID], [ROOT_ID], [ROOT_ID]],
        [[ROOT_ID, *b"E"], [ROOT_ID, *b"A"], [ROOT_ID, *b"E"]],
        [[ROOT_ID, *b"Eu"], [ROOT_ID, *b"Eu"], [ROOT_ID, *b"As"]],  # a fork, a row dropped
        [[ROOT_ID, *b"Asi"], [ROOT_ID, *b"Eur"], [ROOT_ID, *b"Eux"]],  # a reorder and a rejected token
        [[ROOT_ID, *b"Eurx"], [ROOT_ID, *b"Asia"], [ROOT_ID, *b"Eux!"]],  # a new rejection; a dead row goes on
    ]
    for rows in steps:
        scores = processor(torch.tensor(rows), torch.zeros(len(rows), VOCAB_SIZE))
        assert torch.equal(scores, reference_mask(tokenizer_info, [r[1:] for r in rows], regex=ZONE))
    # Rows the grammar cannot continue, and rows after the stop token, allow the stop token only.
    finished = processor(torch.tensor([[ROOT_ID, *b"Eux!"], [ROOT_ID, *b"Asia"]]), torch.zeros(2, VOCAB_SIZE))
    assert torch.isfinite(finished[0]).nonzero().flatten().tolist() == [EOS_ID]
    processor.reset()
    padded = processor(torch.tensor([[ROOT_ID, *b"Asia/Ab", EOS_ID, PAD_ID]]), torch.zeros(1, VOCAB_SIZE))
    assert torch.isfinite(padded[0]).nonzero().flatten().tolist() == [EOS_ID]


def test_grammar_processor_reused_across_generations(models, tokenizer_info):
    """The grammar processor compares prompts exactly (it syncs with the host anyway), so a new
    prompt one column longer than the last input needs no reset()."""
    shared = GrammarLogitsProcessor(tokenizer_info, regex=ZONE)
    first, width = run(models[0], [demo_prompt("Tokyo")], shared, do_sample=False, max_new_tokens=3)
    assert len(demo_prompt("Shanghai")) == first.shape[1]
    for hint in ["Shanghai", "Paris"]:
        fresh, _ = run(models[0], [demo_prompt(hint)], GrammarLogitsProcessor(tokenizer_info, regex=ZONE), do_sample=False)
        reused, _ = run(models[0], [demo_prompt(hint)], shared, do_sample=False)
        assert torch.equal(fresh, reused)


def test_grammar_processor_padded_vocab_and_errors(tokenizer_info):
    processor = GrammarLogitsProcessor(tokenizer_info, choice=["UTC"], prompt_length=1)
    scores = processor(torch.tensor([[ROOT_ID]]), torch.zeros(1, VOCAB_SIZE + 44))
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [ord("U")]
    with pytest.raises(ValueError, match="invalid json constraint"):
        GrammarLogitsProcessor(tokenizer_info, json='{"type": ')
    with pytest.raises(ValueError, match="exactly one way"):
        GrammarLogitsProcessor(tokenizer_info, StructuredOutputsParams(regex="a"), regex="b")
    with pytest.raises(ValueError, match="exactly one way"):
        GrammarLogitsProcessor(tokenizer_info)
    with pytest.raises(ValueError, match="vocab_size is needed"):
        GrammarLogitsProcessor(prefix_dict=load_tree_config())
    with pytest.raises(ValueError, match="stop token id 999"):
        GrammarLogitsProcessor(tokenizer_info, regex="a", stop_token_ids=[999])


def test_processors_in_hf_assisted_generation(models, tree, tokenizer_info):
    """HF's own speculative decoding (assistant_model) calls processors with lengths that jump;
    with prompt_length given, the output equals plain constrained greedy decoding."""
    target, draft = models
    prompt = torch.tensor([demo_prompt("Narnia")])
    width = prompt.shape[1]
    for make in (
        lambda: TreeLogitsProcessor(tree, prompt_length=width),
        lambda: GrammarLogitsProcessor(tokenizer_info, regex=ZONE, prompt_length=width),
    ):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW, logits_processor=LogitsProcessorList([make()]))
        assisted = target.generate(
            prompt, do_sample=False, max_new_tokens=MAX_NEW, assistant_model=draft, logits_processor=LogitsProcessorList([make()])
        )
        assert torch.equal(plain, assisted)


# ---------------------------------------------------------------------------------------------
# A tree whose end token is not EOS: tree_generation_kwargs stops there


@pytest.mark.parametrize("mode", ["greedy", "sampling", "beams-n"])
def test_generation_stops_at_a_tree_end_token_that_is_not_eos(models, tok, catalog, mode):
    from logitgate.integrations.transformers import tree_generation_kwargs
    from logitgate.models.demo import build_prefix_dict

    newline = tok.encode("\n")[0]
    config = build_prefix_dict([tok.encode(n) for n in sorted(catalog)], start_token_id=ROOT_ID, end_token_id=newline)
    tree = TreeDFA.from_prefix_dict(config)
    kwargs, per_prompt = DECODING[mode]
    prompts = [demo_prompt("Krakow"), demo_prompt("")]
    ids, mask = left_padded(prompts)
    torch.manual_seed(0)
    # The processor alone: Hugging Face goes on after the end token, which the tree then repeats.
    alone = models[0].generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([TreeLogitsProcessor(tree)]),
                               max_new_tokens=MAX_NEW, **kwargs)
    assert alone.shape[1] - ids.shape[1] == MAX_NEW
    torch.manual_seed(0)
    out = models[0].generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, **kwargs,
                             **tree_generation_kwargs(tree, models[0]))
    assert out.shape[0] == len(prompts) * per_prompt and out.shape[1] - ids.shape[1] < MAX_NEW
    for row in out:
        tokens = row[ids.shape[1]:].tolist()
        end = tokens.index(newline)  # the end token once, then only padding
        assert tok.decode(tokens[:end]) in catalog
        assert set(tokens[end + 1:]) <= {PAD_ID}


def test_tree_generation_kwargs_keep_the_models_eos(models, tree):
    from logitgate.integrations.transformers import tree_generation_kwargs

    assert tree_generation_kwargs(tree, models[0])["eos_token_id"] == [EOS_ID]  # the catalog tree ends in EOS
    assert tree_generation_kwargs(tree, eos_token_id=[7, EOS_ID])["eos_token_id"] == [7, EOS_ID]
    assert tree_generation_kwargs(tree)["eos_token_id"] == [EOS_ID]
