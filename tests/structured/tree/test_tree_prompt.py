"""A prefix-dict tree applied to a prompt that does not end in its start_token_id: each integration
that sees the prompt warns once per request (never per step), and never for tries or good prompts."""
import logging

import torch

from logitgate import TreeDFA
from logitgate.decode import Request, generate
from logitgate.integrations.transformers import TreeLogitsProcessor
from logitgate.sampling import SamplingParams
from logitgate.sampling.processors import BatchUpdateBuilder, Tree
from logitgate.structured.tree.prompt import prompt_start_problem

V, EOS, START = 16, 1, 15
CONFIG = {"start_token_id": START, "end_token_id": EOS, "prefix_dict": {"15": [4, 5], "15_4": [6], "15_4_6": [EOS]}}
TREE = TreeDFA.from_prefix_dict(CONFIG, vocab_size=V)
TRIE = TreeDFA.from_sequences([[4, 6]], end_token_id=EOS, vocab_size=V)
LOGGER = "logitgate.structured.tree.prompt"


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_start_token_and_the_problem():
    assert TREE.start_token_id == START and TRIE.start_token_id is None
    assert prompt_start_problem(TREE, [3, START]) is None
    assert prompt_start_problem(TRIE, [3]) is None  # tries and sequences have no start token
    assert prompt_start_problem(TREE, None) is None  # the prompt is unknown
    assert "ends in token 3, not in the prefix dict's start_token_id 15" in prompt_start_problem(TREE, [START, 3])
    assert "the prompt is empty" in prompt_start_problem(TREE, [])


def test_logits_processor_warns_once_per_added_request(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    proc = Tree(V, eos_token_id=EOS)
    outputs = [[], [], []]
    builder = BatchUpdateBuilder()
    builder.add(0, SamplingParams(extra_args={"tree_decode": CONFIG}), [2, 3], outputs[0])  # bad
    builder.add(1, SamplingParams(extra_args={"tree_decode": CONFIG}), [2, START], outputs[1])  # good
    builder.add(2, SamplingParams(), [2, 3], outputs[2])  # no tree
    proc.update_state(builder.get_and_reset(3))
    for token in (4, 6):  # decode steps: no further warnings
        proc.update_state(None)
        proc.apply(torch.zeros(3, V))
        outputs[0].append(token)
        outputs[1].append(token)
    assert warnings_in(caplog) == [
        "tree_decode request added at row 0: the prompt ends in token 3, not in the prefix dict's start_token_id "
        "15: decoding starts at the tree's root as if 15 had been the last token (append 15 to the prompt)"
    ]
    builder.add(2, SamplingParams(extra_args={"tree_decode": CONFIG}), [9], [])  # another request
    proc.update_state(builder.get_and_reset(3))
    assert len(warnings_in(caplog)) == 2 and "row 2: the prompt ends in token 9" in warnings_in(caplog)[1]


def test_hf_processor_warns_once_per_generation(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    proc = TreeLogitsProcessor(TREE)
    ids = torch.tensor([[2, START], [2, 3], [0, 7]])  # rows 1 and 2 miss the start token
    for token in (4, 6, EOS):  # one generation, three steps
        proc(ids, torch.zeros(3, V))
        ids = torch.cat([ids, torch.full((3, 1), token)], 1)
    assert len(warnings_in(caplog)) == 1
    assert warnings_in(caplog)[0].startswith("generate() row(s) 1, 2: the prompt ends in token 3, not in")
    proc(torch.tensor([[START]]), torch.zeros(1, V))  # a new generation with a good prompt
    proc(torch.tensor([[5, 5, 5, 5, 5]]), torch.zeros(1, V))  # a new one with a bad prompt
    assert len(warnings_in(caplog)) == 2 and "row(s) 0: the prompt ends in token 5" in warnings_in(caplog)[1]
    TreeLogitsProcessor(TRIE)(torch.tensor([[3]]), torch.zeros(1, V))  # a trie has no start token
    assert len(warnings_in(caplog)) == 2


def test_generate_warns_once_per_request(caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))

    def model(input_ids):
        return table[input_ids]

    params = SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=6)
    requests = [Request([2, 3], params, tree=TREE), Request([2, START], params, tree=TREE), Request([3], params, tree=TRIE)]
    result = generate(model, requests, eos_token_id=EOS)
    assert len(result.outputs) == 9
    assert warnings_in(caplog) == [
        "requests[0]: the prompt ends in token 3, not in the prefix dict's start_token_id 15: decoding starts at "
        "the tree's root as if 15 had been the last token (append 15 to the prompt)"
    ]
