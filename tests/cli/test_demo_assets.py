"""The embedded demo assets: byte tokenizer, the target / draft models, the catalog and its tree."""
from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logitgate.models import (
    BOS_ID,
    DEMO_DIR,
    EOS_ID,
    PAD_ID,
    ROOT_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    build_prefix_dict,
    catalog_prefix_dict,
    demo_prompt,
    load_catalog,
    load_tree_config,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOK = ByteTokenizer()


# --- tokenizer ---------------------------------------------------------------------------------


@given(st.text())
def test_tokenizer_round_trips_any_text(text):
    ids = TOK(text)
    assert ids == TOK.encode(text) == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text
    framed = TOK.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == BOS_ID and framed[-1] == EOS_ID
    assert TOK.decode(framed) == text


def test_tokenizer_special_tokens():
    assert (BOS_ID, EOS_ID, PAD_ID, ROOT_ID, VOCAB_SIZE) == (256, 257, 258, 259, 260)
    ids = demo_prompt("Europe") + TOK("Europe/Berlin") + [EOS_ID, PAD_ID]
    assert ids[0] == BOS_ID and ids[7] == ROOT_ID
    assert TOK.decode(ids) == "EuropeEurope/Berlin"
    assert TOK.decode(ids, skip_special_tokens=False) == "<bos>Europe<root>Europe/Berlin<eos><pad>"
    assert [TOK.is_special(i) for i in (0, 255, 256, 259)] == [False, False, True, True]
    # Skipped special tokens vanish; rendered ones split a multi-byte character, which then decodes
    # to replacement characters rather than raising.
    assert TOK.decode([0xC3, BOS_ID, 0xA9]) == "é"
    assert TOK.decode([0xC3, BOS_ID, 0xA9], skip_special_tokens=False) == "\ufffd<bos>\ufffd"
    assert TOK.decode(TOK("é")) == "é"


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, 10**6])
def test_tokenizer_rejects_unknown_ids(bad):
    with pytest.raises(ValueError, match=f"token id {bad} at position 1"):
        TOK.decode([65, bad])


def test_tokenizer_rejects_non_text():
    with pytest.raises(ValueError, match="bytes"):
        TOK.encode(b"abc")  # type: ignore[arg-type]


def test_token_bytes_make_an_xgrammar_vocabulary():
    vocab = TOK.token_bytes()
    assert len(vocab) == VOCAB_SIZE and vocab[65] == b"A" and vocab[BOS_ID] == b""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(vocab, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS_ID])
    assert set(info.special_token_ids) == {BOS_ID, PAD_ID, ROOT_ID}
    assert list(info.stop_token_ids) == [EOS_ID]


# --- catalog and tree --------------------------------------------------------------------------


def _walk(config: dict, tokens: list[int]) -> list[int]:
    """RTP-LLM's tree decode: the allowed tokens after `tokens`, starting from the root key; a
    missing key (or the error state) allows only the end token."""
    key = str(config["start_token_id"])
    for token in tokens:
        if token not in (config["prefix_dict"].get(key) or [config["end_token_id"]]):
            return [config["end_token_id"]]
        key = f"{key}{config['sep']}{token}"
    return config["prefix_dict"].get(key) or [config["end_token_id"]]


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.fixture(scope="module")
def tree():
    return load_tree_config()


def test_catalog_is_the_time_zone_names(catalog):
    assert 500 <= len(catalog) <= 700 and len(set(catalog)) == len(catalog)
    assert {"Europe/Berlin", "America/New_York", "Asia/Tokyo", "UTC"} <= set(catalog)
    assert all(name.isascii() and name.strip() == name for name in catalog)


def test_tree_is_the_catalogs_prefix_dict(catalog, tree):
    assert tree["start_token_id"] == ROOT_ID and tree["end_token_id"] == EOS_ID and tree["sep"] == "_"
    assert tree == json.loads(json.dumps(catalog_prefix_dict(catalog)))
    assert all(key.split("_")[0] == str(ROOT_ID) for key in tree["prefix_dict"])


def test_tree_accepts_every_name_then_only_eos(catalog, tree):
    names = set(catalog)
    for name in catalog:
        ids = TOK(name)
        for i, token in enumerate(ids):
            assert token in _walk(tree, ids[:i]), (name, i)
        after = _walk(tree, ids)
        assert EOS_ID in after
        is_prefix = any(other != name and other.startswith(name) for other in names)
        assert is_prefix or after == [EOS_ID], name
    # A name that is a prefix of another allows both ending and going on.
    assert set(_walk(tree, TOK("Etc/GMT"))) >= {EOS_ID, ord("+"), ord("-")}


def test_tree_rejects_names_outside_the_catalog(tree):
    ids = TOK("Europe/Munich")
    allowed = [_walk(tree, ids[:i]) for i in range(len(ids))]
    assert any(token not in options for token, options in zip(ids, allowed))
    assert _walk(tree, ids) == [EOS_ID]  # RTP-LLM's error state: only the end token


def test_build_prefix_dict_small_and_errors():
    config = build_prefix_dict([[5, 6], [5], [7]], start_token_id=1, end_token_id=2, sep="-")
    assert config == {
        "start_token_id": 1,
        "end_token_id": 2,
        "sep": "-",
        "prefix_dict": {"1": [5, 7], "1-5": [2, 6], "1-5-6": [2], "1-7": [2]},
    }
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        build_prefix_dict([[5], []], start_token_id=1, end_token_id=2)
    with pytest.raises(ValueError, match="sequence 0 contains the start or end token 2"):
        build_prefix_dict([[5, 2]], start_token_id=1, end_token_id=2)


# --- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    from logitgate.models import load_demo_models

    # No network: loading must work from the package data alone.
    original = socket.socket.connect

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"network access while loading the demo models: {args}")

    socket.socket.connect = refuse
    try:
        return load_demo_models()
    finally:
        socket.socket.connect = original


def test_model_files_are_small_safetensors():
    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "config.json", "catalog.txt", "tree.json"}
    assert sum(p.stat().st_size for p in files) < 5 * 2**20
    assert not list(DEMO_DIR.rglob("*.bin"))


def test_models_load_offline_with_the_tokenizers_vocab(models):
    target, draft = models
    assert target.config.vocab_size == draft.config.vocab_size == VOCAB_SIZE
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    assert sum(p.numel() for p in target.parameters()) > 3 * sum(p.numel() for p in draft.parameters())
    ids = torch.tensor([demo_prompt("Europe") + TOK("Europe/Be")])
    with torch.no_grad():
        for model in models:
            assert not model.training
            logits = model(input_ids=ids).logits
            assert logits.shape == (1, ids.shape[1], VOCAB_SIZE) and logits.dtype == torch.float32
            assert torch.isfinite(logits).all()


def _greedy_names(model, prompts: list[list[int]]) -> list[str | None]:
    """HF `generate` greedy continuations of equal-length prompts; None where no <eos> came."""
    out = model.generate(input_ids=torch.tensor(prompts), do_sample=False, max_new_tokens=40)
    rows = out[:, len(prompts[0]):].tolist()
    return [TOK.decode(row[: row.index(EOS_ID)]) if EOS_ID in row else None for row in rows]


def test_unconstrained_greedy_is_mostly_a_catalog_name(models, catalog):
    """Without the tree the target still writes a catalog name after most first letters; the demo
    shows the tree constraint making it 100%."""
    target, _ = models
    names = set(catalog)
    firsts = sorted({name[0] for name in catalog})
    outputs = _greedy_names(target, [demo_prompt() + TOK(c) for c in firsts])
    valid = [c + out in names for c, out in zip(firsts, outputs) if out is not None]
    rate = sum(valid) / len(firsts)
    print(f"unconstrained greedy validity over {len(firsts)} first letters: {rate:.2f}")
    assert rate >= 0.6


def test_off_catalog_prompts_make_the_unconstrained_model_invent_names(models, catalog):
    """For cities the catalog lacks the target makes names up: what the demo's tree constraint prevents."""
    target, _ = models
    names = set(catalog)
    outputs = [_greedy_names(target, [demo_prompt(city)])[0] for city in ("Krakow", "Seattle", "Geneva", "Dallas", "Hanoi")]
    assert any(out not in names for out in outputs), outputs


def test_draft_agrees_with_target_on_catalog_names(models, catalog):
    """Per name position, the draft's greedy choice is mostly the target's: that is the greedy
    acceptance rate speculative decoding will see."""
    target, draft = models
    seqs = [demo_prompt() + TOK(name) + [EOS_ID] for name in catalog[::4]]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for row, s in enumerate(seqs):
        keep[row, 1 : len(s) - 1] = True  # positions from <root> up to the last name byte
    with torch.no_grad():
        agree = (target(input_ids=ids).logits.argmax(-1) == draft(input_ids=ids).logits.argmax(-1))[keep]
    rate = agree.float().mean().item()
    print(f"draft/target argmax agreement on catalog names: {rate:.3f}")
    assert rate >= 0.7
