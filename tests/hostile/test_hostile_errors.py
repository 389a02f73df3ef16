"""Unclear errors turned into clear ones (issue 13 items 8 and 9): each bad input gets a ValueError
(exit status 2 on the command line) naming the file, key, row or token, and changes nothing."""

import numpy as np
import pytest
import torch

from logitgate import TreeDFA
from logitgate.cli import main
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
from logitgate.sampling.processors import BatchUpdate, BatchUpdateBuilder, MoveDirectionality, builtin_logits_processors
from logitgate.sampling.rejection import rejection_sample
from logitgate.structured import RequestStatus, StructuredOutputManager, StructuredOutputsParams

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "9" * 5000


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, message",
    [
        (DEEP, "is nested too deeply"),
        ('{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [' + HUGE + "]}}", "cannot be read: Exceeds the limit"),
        ("42", "is a JSON int; expected a prefix-dict config"),
    ],
)
def test_tree_inspect_bad_files_exit_2_with_the_file_named(tmp_path, capsys, text, message):
    path = write(tmp_path, "t.json", text)
    assert main(["tree", "inspect", path]) == 2
    err = capsys.readouterr().err
    assert f"tree file {path!r}" in err and message in err and "file file" not in err and "Traceback" not in err


def test_demo_with_a_deeply_nested_tree_exits_2(tmp_path, capsys):
    path = write(tmp_path, "t.json", '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": ' + DEEP + "}")
    assert main(["demo", "--tree", path]) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_a_5000_digit_key_part_is_named_with_its_key():
    with pytest.raises(ValueError, match=r"prefix_dict key '1_9999.*: part '9999.*\.\.\. exceeds the int32 range"):
        TreeDFA.from_prefix_dict({"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1_" + HUGE: [3]}})
    with pytest.raises(ValueError, match=r"candidate <an integer of about 5001 digits> exceeds the int32 range"):
        TreeDFA.from_prefix_dict({"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [10**5000]}})


def test_logprobs_beyond_the_vocabulary():
    params = SamplingParams(logprobs=11)
    with pytest.raises(ValueError, match=r"logprobs=11 asks for more log-probabilities than the vocabulary has \(10\)"):
        params.verify(10)
    with pytest.raises(ValueError, match="logprobs=11 asks for more"):
        Sampler()(torch.randn(2, 10), SamplingMetadata.from_params([params, SamplingParams()]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.add(4, SamplingParams(), None, []), "a request is added at row 4, outside the batch of 4 rows"),
        (lambda b: b.move(0, 7), "a request is moved to row 7, outside the batch of 4 rows"),
        (lambda b: b.move(9, 1, MoveDirectionality.SWAP), "a request is swapped from row 9"),
    ],
)
def test_batch_updates_outside_the_batch_are_refused_before_any_processor_sees_them(change, message):
    procs = builtin_logits_processors(32, eos_token_id=0)
    builder = BatchUpdateBuilder()
    change(builder)
    with pytest.raises(ValueError, match=message):
        builder.get_and_reset(4)
    for proc in procs:  # never reached a processor; a valid update still works
        proc.update_state(BatchUpdate(4, [], [(3, SamplingParams(min_p=0.1), None, [])], [(9, 0, MoveDirectionality.UNIDIRECTIONAL)]))


def test_sizes_and_ids_that_are_not_integers():
    for bad in (True, 40.0, torch.tensor(40)):
        with pytest.raises(ValueError, match="vocab_size"):
            StructuredOutputManager(vocab_size=bad)
    with StructuredOutputManager(vocab_size=300) as manager:
        manager.add_request("r", StructuredOutputsParams(token_trie={"modelId": "m", "descriptors": [{"path": "a", "leaves": [
            {"name": "x", "tokens": [121, 122]}]}], "end_token_id": 1}))
        assert manager.wait("r") is RequestStatus.READY
        for bad in (121.9, 121.0, True):
            with pytest.raises(ValueError, match=r"token id .* of request 'r' is not an integer"):
                manager.accept_tokens("r", [bad])
            with pytest.raises(ValueError, match="is not an integer"):
                manager.validate_tokens("r", [bad])
        assert manager.accept_tokens("r", [np.int64(121)])  # numpy integers are integers
        assert manager.validate_tokens("r", [122, 1]) == [122, 1]


def test_numpy_draft_counts_are_accepted():
    out = rejection_sample(torch.tensor([3]), [np.int64(1), np.int32(0)], torch.randn(1, 10), torch.tensor([1, 2]))
    assert out.shape == (2, 2)


def test_seeds_torch_cannot_take_are_refused_up_front():
    with pytest.raises(ValueError, match="seed must be an int in"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match="seed must be an int in"):
        SamplingParams(seed=2**64 - 1, n=2)  # sample 1 would use seed + 1
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))


def test_a_plus_inf_logit_is_the_token_a_sampled_row_draws():
    logits = torch.randn(3, 50)
    logits[:, 17] = float("inf")
    out = Sampler(backend="cpu")(logits, SamplingMetadata.from_params([SamplingParams(temperature=1.0)] * 3))
    assert out.sampled_token_ids.flatten().tolist() == [17, 17, 17]
