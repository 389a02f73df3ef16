"""generate() and the demo when a tree's end token is not EOS (RTP-LLM trees often end with a
separator): nothing may follow the end of the constraint, whatever drafts were proposed."""
import contextlib
import io
import json

import pytest
import torch

from logitgate import TreeDFA
from logitgate.cli import main
from logitgate.cli.demo import _check, tree_output_check
from logitgate.decode.generate import Request, generate
from logitgate.models import catalog_prefix_dict
from logitgate.sampling import SamplingParams
from logitgate.structured import StructuredOutputManager, StructuredOutputsParams

V, END = 300, 258


def fixed_model(ids):
    """Prefers the end token everywhere, then 65: after the tree ends it would go on emitting 258."""
    out = torch.zeros(ids.shape[0], ids.shape[1], V)
    out[..., END] = 5.0
    out[..., 65] = 4.0
    out[..., 7] = 3.0
    return out


@pytest.mark.parametrize(
    "options",
    [
        dict(jump_forward=False),
        dict(jump_forward=True),
        dict(jump_forward=False, draft_model=fixed_model, num_speculative_tokens=4),
        dict(jump_forward=True, draft_model=fixed_model, num_speculative_tokens=4),
        dict(jump_forward=True, ngram=1, num_speculative_tokens=4),
    ],
    ids=["plain", "jump-forward", "draft-model", "draft-model+jump-forward", "ngram+jump-forward"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nothing_follows_the_end_of_a_tree_whose_end_token_is_not_eos(options, temperature):
    tree = TreeDFA.from_sequences([[65], [7, 65]], end_token_id=END, vocab_size=V)
    params = SamplingParams(temperature=temperature, max_tokens=10, seed=1 if temperature else None)
    result = generate(fixed_model, [Request([1, 2], params, tree=tree)], eos_token_id=0, **options)
    out = result.outputs[0]
    assert out.token_ids[-1] == END and out.token_ids.count(END) == 1, out.token_ids
    assert tree_output_check(tree, out.token_ids) and out.finish_reason == "constraint"
    if temperature == 0.0:
        assert out.token_ids == [65, END]


@pytest.mark.parametrize(
    "options",
    [dict(jump_forward=False), dict(draft_model=fixed_model, num_speculative_tokens=4), dict(ngram=1, num_speculative_tokens=4)],
    ids=["plain", "draft-model", "ngram"],
)
def test_nothing_follows_the_end_of_a_manager_constraint(options):
    # The same tree as a prefix dict through the StructuredOutputManager (GrammarConstraint).
    config = {"start_token_id": 2, "end_token_id": END, "prefix_dict": {"2": [65, 7], "2_7": [65], "2_65": [END], "2_7_65": [END]}}
    with StructuredOutputManager(vocab_size=V, num_speculative_tokens=4) as manager:
        params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(prefix_dict=config))
        result = generate(fixed_model, [Request([1, 2], params)], eos_token_id=0, manager=manager, **options)
    out = result.outputs[0]
    assert out.token_ids == [65, END] and out.finish_reason == "constraint"


def test_tree_output_check_rejects_tokens_after_the_end_token():
    tree = TreeDFA.from_sequences([[65]], end_token_id=END, vocab_size=V)
    assert tree_output_check(tree, [65, END])
    assert not tree_output_check(tree, [65, END, END])


def test_demo_fails_when_greedy_speculative_outputs_differ(monkeypatch, capsys):
    runs = [
        {"name": "plain", "constraint": "tree", "baseline": None, "temperature": 0.0,
         "outputs": [{"hint": "h", "text": "a", "token_ids": [65, END], "valid": True}]},
        {"name": "spec", "constraint": "tree", "baseline": "plain", "temperature": 0.0,
         "outputs": [{"hint": "h", "text": "a", "token_ids": [65, END, END], "valid": True}]},
    ]
    check = _check(runs)
    assert check["all_constrained_valid"] and check["greedy_speculative_matches_plain"] == {"spec": False}
    assert check["ok"] is False

    import logitgate.cli.demo as demo
    import logitgate.cli.demo_report as demo_report

    monkeypatch.setattr(demo, "run_demo", lambda **_: {"check": check})
    monkeypatch.setattr(demo_report, "format_report", lambda data: "report")
    assert main(["demo"]) == 1


def test_demo_with_a_tree_ending_in_a_separator_matches_plain_greedy(tmp_path):
    config = catalog_prefix_dict(["Europe/Berlin", "Europe/Warsaw", "Asia/Tokyo", "America/Chicago"])
    config["end_token_id"] = END  # the byte tokenizer's padding id: not EOS
    config["prefix_dict"] = {k: [END if t == 257 else t for t in v] for k, v in config["prefix_dict"].items()}
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["demo", "--json", "--quick", "--tree", str(path)])
    report = json.loads(out.getvalue())
    assert all(report["check"]["greedy_speculative_matches_plain"].values()), report["check"]
    assert status == 0 and report["check"]["ok"]
    for run in report["runs"]:
        if run["constraint"] == "tree":
            for o in run["outputs"]:
                assert o["token_ids"].count(END) == 1 and o["token_ids"][-1] == END
