"""One answer to "is this an integer?" at every boundary (logitgate/checks.py): the shared checks,
SamplingParams and the tree loaders accept and refuse the same values. Python ints, int subclasses
(an IntEnum of special tokens) and numpy integers are integers, kept as plain ints; bools (Python's
and numpy's), floats, strings and tensors are not, even where int() would take them."""
import enum

import numpy as np
import pytest
import torch

from logitgate import TreeDFA
from logitgate.checks import as_token_id, is_integer, is_integer_type
from logitgate.sampling import SamplingParams
from logitgate.structured.tree.loaders import check_token_id


class Special(enum.IntEnum):
    FIVE = 5


class Token(int):
    pass


INTEGERS = [5, np.int64(5), np.int32(5), np.uint8(5), Special.FIVE, Token(5)]
NOT_INTEGERS = [True, False, np.bool_(True), 5.0, np.float32(5), "5", None, torch.tensor(5), [5]]


@pytest.mark.parametrize("value", INTEGERS, ids=lambda v: type(v).__name__)
def test_every_boundary_takes_an_integer_as_a_plain_int(value):
    assert is_integer(value) and is_integer_type(type(value))
    assert type(as_token_id(value, 32)) is int and type(check_token_id(value, "end_token_id", 32)) is int
    params = SamplingParams(top_k=value, seed=value, stop_token_ids=[value], logit_bias={value: 1.0})
    assert [type(x) for x in (params.top_k, params.seed, *params.stop_token_ids, *params.logit_bias)] == [int] * 4
    tree = TreeDFA.from_sequences([[value, 6]], end_token_id=0, vocab_size=32, cache=False)
    assert tree.allowed(tree.root) == [5]


@pytest.mark.parametrize("value", NOT_INTEGERS, ids=repr)
def test_every_boundary_refuses_what_is_not_an_integer(value):
    assert not is_integer(value) and not is_integer_type(type(value))
    with pytest.raises(ValueError, match="is not an integer"):
        as_token_id(value, 32)
    with pytest.raises(ValueError, match="is not an integer token id"):
        check_token_id(value, "end_token_id", 32)
    with pytest.raises(ValueError, match="top_k must be an int"):
        SamplingParams(top_k=value)
    with pytest.raises(ValueError, match="stop_token_ids has"):
        SamplingParams(stop_token_ids=[value])
    with pytest.raises(ValueError, match="is not an integer token id"):
        TreeDFA.from_sequences([[value, 6]], end_token_id=0, vocab_size=32, cache=False)


# isinstance checks on int that are not "is it an integer?" (a number of either kind, a key part's
# type, the type of a member another library keeps), by module and the line's text
NOT_INTEGER_CHECKS = {
    "cli/bench.py": "isinstance(value, (int, float))",  # a JSON number, int or float
    "structured/tree/candidates.py": "isinstance(value, (int, float))",  # a probability
    "structured/compile_cache.py": "isinstance(part, (bool, int, float))",  # a cache key's scalar parts
    "integrations/llama_cpp/private_reads.py": "isinstance(obj, int)",  # llama-cpp-python's member is an int
}


def test_no_module_checks_integers_by_hand():
    """checks.is_integer is the one answer: a hand-written isinstance(x, int) disagrees with it at
    the edges (bools pass, numpy integers fail)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "logitgate"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "checks.py":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2):
                continue
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = {ast.unparse(k) for k in kinds}
            if names & {"int", "np.integer", "numpy.integer"} and ast.unparse(node) not in NOT_INTEGER_CHECKS.get(rel, ""):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "use checks.is_integer:\n" + "\n".join(found)


def test_checks_loads_no_numpy_and_still_knows_numpy_integers():
    import subprocess
    import sys

    code = ("import sys; import logitgate.checks as c; assert 'numpy' not in sys.modules; "
            "assert c.is_integer(3) and not c.is_integer(True); import numpy as np; "
            "assert c.is_integer(np.int64(3)) and not c.is_integer(np.bool_(True))")
    subprocess.run([sys.executable, "-c", code], check=True)
