"""The demo's byte tokenizer as a Hugging Face tokenizer saved with the demo models: the same ids as
`ByteTokenizer`, loadable by AutoTokenizer, xgrammar and vLLM, and usable by `demo --model`."""
import json

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from logitgate.models import (
    BOS_ID,
    DRAFT_DIR,
    EOS_ID,
    ROOT_ID,
    SPECIAL_TOKENS,
    TARGET_DIR,
    VOCAB_SIZE,
    ByteTokenizer,
    demo_hf_tokenizer,
    demo_prompt,
)
from logitgate import token_ids_from_bitmask
from logitgate.models.hf_byte_tokenizer import build_hf_byte_tokenizer

pytest.importorskip("transformers")
xgr = pytest.importorskip("xgrammar")

BYTES = ByteTokenizer()
HF = demo_hf_tokenizer()


@given(st.text())
def test_same_ids_as_the_byte_tokenizer_on_any_text(text):
    assume(not any(name in text for name in SPECIAL_TOKENS))  # their text is the special token in HF
    ids = BYTES.encode(text)
    assert HF.encode(text, add_special_tokens=False) == ids
    assert HF(text)["input_ids"] == [BOS_ID, *ids]  # as Llama tokenizers, it adds BOS by default
    assert HF.decode(ids) == BYTES.decode(ids) == text


@given(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=24), st.booleans())
def test_same_text_as_the_byte_tokenizer_for_any_ids(ids, skip_special_tokens):
    # Including special tokens between the bytes of a character, and invalid UTF-8.
    assert HF.decode(ids, skip_special_tokens=skip_special_tokens) == BYTES.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_and_prompts():
    assert len(HF) == VOCAB_SIZE
    assert (HF.bos_token_id, HF.eos_token_id, HF.pad_token_id) == (BYTES.bos_token_id, BYTES.eos_token_id, BYTES.pad_token_id)
    assert HF.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(SPECIAL_TOKENS.values())
    assert HF("Berlin<root>")["input_ids"] == demo_prompt("Berlin")  # a text prompt an engine can take
    assert HF.padding_side == "left"


def test_shipped_files_are_what_the_code_builds(tmp_path):
    build_hf_byte_tokenizer().save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        built = json.loads((tmp_path / name).read_text())
        for directory in (TARGET_DIR, DRAFT_DIR):
            assert json.loads((directory / name).read_text()) == built, f"{directory / name} is stale"


def test_xgrammar_tokenizer_info_from_huggingface_matches_the_raw_one():
    info = xgr.TokenizerInfo.from_huggingface(HF, vocab_size=VOCAB_SIZE)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [EOS_ID]
    assert info.decoded_vocab[:256] == [bytes([b]) for b in range(256)]
    raw = xgr.TokenizerInfo(BYTES.token_bytes(), vocab_size=VOCAB_SIZE, stop_token_ids=[EOS_ID])
    schema = json.dumps({"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]})
    matchers = [xgr.GrammarMatcher(xgr.GrammarCompiler(i).compile_json_schema(schema)) for i in (info, raw)]
    masks = xgr.allocate_token_bitmask(2, VOCAB_SIZE)
    for token in [*BYTES.encode('{"zone": "Asia/Tokyo"}'), EOS_ID]:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(masks, row)
        hf_allowed, raw_allowed = token_ids_from_bitmask(masks, VOCAB_SIZE)
        # The same bytes and stop token at every step. xgrammar 0.2.8 treats only tokens that decode
        # to nothing as special, so from_huggingface also lets "<root>" etc. into a JSON string as
        # text (docs/versions.md, "xgrammar caveats"); the RAW info has them empty, hence special.
        assert [t for t in hf_allowed if t < 256 or t == EOS_ID] == raw_allowed
        assert all(m.accept_token(token) for m in matchers)
    assert all(m.is_terminated() for m in matchers)


def test_hugging_face_loads_model_and_tokenizer_from_one_directory():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, local_files_only=True, dtype=torch.float32).eval()
    batch = tok(["Berlin<root>", "Tokyo<root>"], return_tensors="pt", padding=True)
    out = model.generate(**batch, do_sample=False, max_new_tokens=40)
    names = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert names == ["Europe/Berlin", "Asia/Tokyo"]


def test_vllm_loads_the_tokenizer():
    pytest.importorskip("vllm")
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # older vLLM
        from vllm.transformers_utils.tokenizer import get_tokenizer
    tok = get_tokenizer(str(TARGET_DIR))
    assert tok.encode("Berlin<root>") == demo_prompt("Berlin") and tok.eos_token_id == EOS_ID
    assert ROOT_ID in tok.all_special_ids


def test_demo_runs_on_the_embedded_model_directory(monkeypatch):
    """`logitgate demo --model logitgate/data/demo/target --draft-model .../draft` loads model and
    tokenizer like any Hugging Face directory. With the prompt the models were trained on
    ("<hint><root>": the tokenizer adds <bos>) its tree-greedy names are the target's own
    tree-constrained greedy names from the byte-tokenizer path."""
    import contextlib
    import io

    from transformers import LogitsProcessorList

    from logitgate import TreeDFA
    from logitgate.cli import demo, main
    from logitgate.integrations.transformers import TreeLogitsProcessor
    from logitgate.models import load_catalog, load_demo_model, load_tree_config

    monkeypatch.setattr(demo, "MODEL_PROMPT", "{hint}<root>")  # instead of a long English prompt
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["demo", "--json", "--quick", "--threads", "1", "--model", str(TARGET_DIR), "--draft-model", str(DRAFT_DIR)])
    report = json.loads(out.getvalue())
    assert status == 0 and report["check"]["all_constrained_valid"] and report["vocab_size"] == VOCAB_SIZE
    catalog = set(load_catalog())
    runs = {r["name"]: r for r in report["runs"]}
    greedy = {o["hint"]: o["text"] for o in runs["tree greedy"]["outputs"]}
    assert set(greedy.values()) <= catalog
    target = load_demo_model("target")
    tree = TreeDFA.from_prefix_dict(load_tree_config())
    for hint, name in greedy.items():
        prompt = torch.tensor([demo_prompt(hint)])
        own = target.generate(prompt, do_sample=False, max_new_tokens=40,
                              logits_processor=LogitsProcessorList([TreeLogitsProcessor(tree)]))
        assert BYTES.decode(own[0, prompt.shape[1]:]) == name, hint
    assert runs["tree greedy + spec"]["stats"]["accepted_drafts"] > 0  # the draft directory's model drafted
