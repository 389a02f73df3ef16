"""`logitgate demo`: the end-to-end demo runs, every constrained output is valid, speculative decoding
saves forward passes, bad input fails with a clear error and exit status 2."""
import contextlib
import io
import json
import os

import pytest

from logitgate.backends import ENV_VAR
from logitgate.cli import main
from logitgate.cli.demo import CONFIGS, JSON_SCHEMA, json_output_problem, tree_output_check
from logitgate.cli.demo_report import format_report
from logitgate.models import catalog_prefix_dict, demo_tokenizer, load_catalog

USER_NAMES = ["Europe/Berlin", "Europe/Warsaw", "Asia/Tokyo", "America/Chicago"]


PHASES = {}  # stderr of the module's demo run


def run_json(*args: str, stderr: io.StringIO | None = None) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(stderr or io.StringIO()):
        assert main(["demo", "--json", "--quick", *args]) == 0
    return json.loads(out.getvalue())  # nothing but the JSON object on stdout


@pytest.fixture(scope="module")
def report():
    err = io.StringIO()
    data = run_json("--progress", stderr=err)
    PHASES["stderr"] = err.getvalue()
    return data


def test_progress_lines_per_phase_on_stderr_never_in_the_json(report):
    lines = PHASES["stderr"].splitlines()
    assert lines[0].startswith("[demo ") and "loading the embedded models" in lines[0] and "1 thread)" in lines[0]
    assert "warm-up: numba kernels" in lines[1] and "warm-up done in" in lines[2]
    runs = [line for line in lines if "] run " in line]
    assert len(runs) == len(CONFIGS) and runs[-1].split("] ")[1].startswith(f"run {len(CONFIGS)}/{len(CONFIGS)} ")
    assert all(line.rstrip().endswith(" s") for line in runs)  # each with its time
    assert "[demo" not in json.dumps(report)


@pytest.mark.parametrize(
    "argv, tty, shown",
    [([], True, True), ([], False, False), (["--json"], True, False), (["--json", "--progress"], False, True),
     (["--no-progress"], True, False)],
)
def test_progress_only_on_a_terminal_or_when_asked(monkeypatch, argv, tty, shown):
    import logitgate.cli.demo as demo_module
    import logitgate.cli.demo_report as report_module

    seen = {}

    def fake_run_demo(**kwargs):
        seen["progress"] = kwargs["progress"]
        return {"check": {"ok": True, "all_constrained_valid": True}}

    monkeypatch.setattr(demo_module, "run_demo", fake_run_demo)
    monkeypatch.setattr(report_module, "format_report", lambda data: "report")
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty, raising=False)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", *argv]) == 0
    assert (seen["progress"] is not None) == shown


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--threads", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


@pytest.fixture
def write_json(tmp_path):
    def write(obj, name="tree.json"):
        path = tmp_path / name
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        return str(path)

    return write


def runs_by_name(report):
    return {r["name"]: r for r in report["runs"]}


def test_every_configuration_runs_and_every_constrained_output_is_valid(report):
    assert [r["name"] for r in report["runs"]] == [c.name for c in CONFIGS]
    assert report["check"]["all_constrained_valid"] and not report["check"]["invalid"]
    catalog = set(load_catalog())
    tok = demo_tokenizer()
    counted = 0
    for run in report["runs"]:
        assert run["outputs"], run["name"]
        for out in run["outputs"]:
            assert tok.decode(out["token_ids"]) == out["text"]
            if run["constraint"] == "tree":
                assert out["valid"] and out["text"] in catalog and out["token_ids"][-1] == tok.eos_token_id
                counted += 1
            elif run["constraint"] == "json":
                obj = json.loads(out["text"])  # checked here independently of the demo's own check
                assert set(obj) == set(JSON_SCHEMA["properties"])
                assert isinstance(obj["zone"], str) and type(obj["utc_offset_hours"]) is int
                assert out["valid"]
                counted += 1
    assert report["check"]["constrained_outputs"] == report["check"]["valid"] == counted
    free = runs_by_name(report)["free greedy"]["outputs"]
    assert report["check"]["unconstrained_invalid"] == sum(o["text"] not in catalog for o in free)


def test_speculative_decoding_saves_forward_passes(report):
    runs = runs_by_name(report)
    for run in report["runs"]:
        stats, metrics = run["stats"], run["metrics"]
        if run["speculative"]:
            assert stats["draft_forward_passes"] > 0 and stats["proposed_drafts"] > 0
            assert 0 < stats["acceptance_rate"] <= 1
        if run["jump_forward"]:
            assert stats["forced_tokens"] > 0
        if run["baseline"]:
            base = runs[run["baseline"]]["stats"]
            assert metrics["forward_passes_saved"] == base["target_forward_passes"] - stats["target_forward_passes"] > 0
        assert 0 <= metrics["overhead_share"] <= 1 and metrics["masking_ms_per_step"] >= 0
        if run["constraint"] != "none":  # a constraint costs time, dense or in the sparse tree step
            assert metrics["masking_ms_per_step"] + metrics["tree_step_ms_per_step"] > 0, run["name"]
    # Greedy verification is exact: drafts and forced tokens change the cost, never the output.
    assert report["check"]["greedy_speculative_matches_plain"] == {
        "tree greedy + spec": True, "tree greedy + jump-fwd": True, "tree greedy + spec + jump-fwd": True
    }


def test_text_report_shows_outputs_check_and_table(report):
    text = format_report(report)
    assert "(a) Unconstrained greedy decoding" in text and "(d) JSON schema through xgrammar" in text
    assert f"Check: {report['check']['valid']} of {report['check']['constrained_outputs']} constrained outputs are valid" in text
    assert "-> OK" in text
    header = next(line for line in text.splitlines() if line.strip().startswith("config "))
    for column in ("passes", "saved", "accept", "forced", "mask ms", "sample ms", "share"):
        assert column in header
    for run in report["runs"]:
        assert run["outputs"][0]["hint"] in text
        assert any(line.strip().startswith(run["name"]) for line in text.splitlines())


@pytest.mark.parametrize(
    "content, message",
    [
        ({"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [64000], "225_64000": [2]}},
         "its token ids do not fit the embedded byte-level demo model"),
        ({"end_token_id": 257, "prefix_dict": {}}, "missing 'start_token_id'"),
        ('{"start_token_id": 1,', "is not valid JSON"),
    ],
)
def test_bad_tree_file_is_a_clear_error_with_status_2(write_json, capsys, content, message):
    path = write_json(content)
    assert main(["demo", "--tree", path]) == 2
    err = capsys.readouterr().err
    assert f"--tree {path!r}" in err and message in err
    if isinstance(content, dict) and "start_token_id" in content:
        assert "candidate 64000" in err and "vocabulary of 260 tokens" in err


def test_missing_tree_file_and_lone_draft_model(capsys, tmp_path):
    assert main(["demo", "--tree", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["demo", "--draft-model", str(tmp_path)]) == 2
    assert "--draft-model needs --model" in capsys.readouterr().err


def test_npu_emulated_with_a_user_tree(write_json):
    saved = os.environ.get(ENV_VAR)
    path = write_json(catalog_prefix_dict(USER_NAMES))
    data = run_json("--device", "npu-emulated", "--tree", path)
    assert os.environ.get(ENV_VAR) == saved  # the demo restores the device selection
    assert data["device"] == "npu-emulated" and data["tree"]["source"] == path
    assert data["check"]["all_constrained_valid"]
    for run in data["runs"]:
        if run["constraint"] == "tree":
            assert {o["text"] for o in run["outputs"]} <= set(USER_NAMES)
    assert all(r["metrics"]["forward_passes_saved"] > 0 for r in data["runs"] if r["baseline"])


def _tiny_hf_model(path):
    """A random one-layer Llama with a byte-level BPE tokenizer trained on the catalog, saved offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(load_catalog(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def test_local_hugging_face_model_with_ngram_drafts(tmp_path):
    _tiny_hf_model(tmp_path)
    data = run_json("--model", str(tmp_path), "--threads", "1")
    assert data["drafter"].startswith("n-gram") and data["vocab_size"] == 400
    assert data["tree"]["catalog_names"] == len(load_catalog())
    assert data["check"]["all_constrained_valid"] and data["check"]["json_outputs"] == 1
    catalog = set(load_catalog())
    assert all(o["text"] in catalog for r in data["runs"] if r["constraint"] == "tree" for o in r["outputs"])


def test_model_dir_errors(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "is not a loadable Hugging Face causal LM" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"zone": "Europe/Berlin", "utc_offset_hours": 1}', None),
        ('{"zone": "Europe/Berlin"}', "keys"),
        ('{"zone": "Europe/Berlin", "utc_offset_hours": true}', "utc_offset_hours True"),
        ('{"zone": "Europe/Berlin", "utc_offset_hours": 15}', "not an integer in [-12, 14]"),
        ('{"zone": "berlin", "utc_offset_hours": 1}', "zone 'berlin'"),
        ('{"zone": "Europe/Berlin", "utc_offset_hours": 1', "not JSON"),
        ("[1]", "not an object"),
    ],
)
def test_json_output_check(text, problem):
    found = json_output_problem(text)
    assert found is None if problem is None else problem in found


def test_tree_output_check():
    from logitgate import TreeDFA

    tok = demo_tokenizer()
    tree = TreeDFA.from_prefix_dict(catalog_prefix_dict(USER_NAMES), vocab_size=tok.vocab_size, device="cpu")
    assert tree_output_check(tree, tok.encode("Asia/Tokyo", add_eos=True))
    assert not tree_output_check(tree, tok.encode("Asia/Tokyo"))  # not ended
    assert not tree_output_check(tree, tok.encode("Asia/Tokyx", add_eos=True))  # left the tree, then ended
    assert not tree_output_check(tree, [tok.vocab_size + 5])
