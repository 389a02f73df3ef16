"""The vLLM front end's tree admission (integrations/vllm/tree_admission.py): parsed, checked
against the vocabulary and the operator's limits, never compiled (issue 22: a huge tree compiled
twice, on the API server's event loop and in the engine)."""
from __future__ import annotations

import json

import pytest

from logitgate import TreeDFA
from logitgate.integrations.vllm.tree.admission import admit
from logitgate.integrations.vllm.tree.args import tree_request_for
from logitgate.sampling import SamplingParams
from logitgate.structured.tree import shape as tree_shape
from logitgate.structured.tree.limits import TreeTooLarge

V = 64
CONFIG = {"start_token_id": 40, "end_token_id": 2, "prefix_dict": {"40": [10, 11], "40_10": [12, 13], "40_10_12": [2]}}
TRIE = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "a", "tokens": [5, 6, 7]}, {"name": "b", "tokens": [5, 8]}]}]}


def request(**extra_args):
    return tree_request_for(SamplingParams(extra_args=extra_args))


def test_shapes_without_compiling():
    TreeDFA.cache_clear()
    shape = admit(request(tree_decode=json.dumps(CONFIG)), V, None)
    assert shape == (40, 2, 1 + 2, 2)  # the root and the 2 keys past it; the longest key has 2 tokens past the start
    assert admit(request(token_trie=TRIE, end_token_id=3), V, None) == (None, 3, 1 + 5, 3)  # the root and 5 tokens
    assert admit(request(token_trie=json.dumps(TRIE)), V, eos_token_id=1).end_token_id == 1  # the model's eos
    assert TreeDFA.cache_info()["size"] == 0


@pytest.mark.parametrize("env, value, source, match", [
    ("LOGITGATE_TREE_MAX_BYTES", "100", json.dumps(CONFIG), r"prefix dict config is too large: its size is \d+ bytes, over the limit of 100 bytes"),
    ("LOGITGATE_TREE_MAX_NODES", "2", CONFIG, r"prefix dict is too large: its node count is 3 nodes, over the limit of 2"),
    ("LOGITGATE_TREE_MAX_DEPTH", "1", CONFIG, r"prefix dict is too large: its depth is 2 tokens, over the limit of 1"),
    ("LOGITGATE_TREE_MAX_DEPTH", "2", TRIE, r"token trie is too large: its depth is 3 tokens"),
    ("LOGITGATE_TREE_MAX_NODES", "5", TRIE, r"token trie is too large: its node count is 6 nodes"),
])
def test_the_operators_limits(monkeypatch, env, value, source, match):
    monkeypatch.setenv(env, value)
    key = "tree_decode" if source in (CONFIG, json.dumps(CONFIG)) else "token_trie"
    args = {key: source} if key == "tree_decode" else {key: source, "end_token_id": 3}
    with pytest.raises(ValueError, match=f"extra_args\\['{key}'\\]: {match}.* \\(the operator's setting {env}\\)"):
        admit(request(**args), V, None)
    monkeypatch.setenv(env, "1000")  # raised: admitted
    admit(request(**args), V, None)


def test_a_hostile_trie_leaf_is_refused_before_its_tokens_are_checked(monkeypatch):
    huge = {"descriptors": [{"path": "p", "leaves": [{"tokens": ["x"] * 500_000}]}]}
    with pytest.raises(ValueError, match="token trie is too large: its depth is 500000 tokens"):
        admit(request(token_trie=huge, end_token_id=1), V, None)


def test_the_operators_trees_are_limited_alike_and_parsed_once_per_content(monkeypatch, tmp_path):
    monkeypatch.setenv("LOGITGATE_TREE_DIR", str(tmp_path))
    (tmp_path / "t.json").write_text(json.dumps(CONFIG))
    assert admit(request(tree_decode="t"), V, None).depth == 2
    monkeypatch.setenv("LOGITGATE_TREE_MAX_DEPTH", "1")
    with pytest.raises(ValueError, match="LOGITGATE_TREE_MAX_DEPTH"):
        admit(request(tree_decode="t"), V, None)
    monkeypatch.delenv("LOGITGATE_TREE_MAX_DEPTH")
    (tmp_path / "t.json").write_text(json.dumps({**CONFIG, "prefix_dict": {"40": [V]}}))  # changed on disk
    with pytest.raises(ValueError, match=f"candidate {V} is >= vocab_size {V}"):
        admit(request(tree_decode="t"), V, None)


def test_a_tree_sent_again_is_not_parsed_again(monkeypatch):

    text = json.dumps({**CONFIG, "prefix_dict": {**CONFIG["prefix_dict"], "40_11": [2]}})
    admit(request(tree_decode=text), V, None)
    monkeypatch.setattr(tree_shape, "_shape", lambda *args: pytest.fail("parsed again"))
    assert admit(request(tree_decode=text), V, None).nodes == 1 + 3  # the root and the keys past it


# ---- every limit's boundary, admission and compile alike (issue 30, item 7) ---------------------

LIMIT_ENV = {"bytes": "LOGITGATE_TREE_MAX_BYTES", "nodes": "LOGITGATE_TREE_MAX_NODES", "depth": "LOGITGATE_TREE_MAX_DEPTH"}
# The trie's two leaves share their first token (5 tokens written, 5 trie nodes with the root): the
# count is the root and every token as written, 6, so a limit of 5 refuses it in both places.
BOUNDARY_TREES = {
    "tree_decode": (json.dumps(CONFIG), {"nodes": 1 + 2, "depth": 2}),
    "token_trie": (json.dumps(TRIE), {"nodes": 1 + 5, "depth": 3}),
}


def _both_sides(kind: str, text: str):
    """(what admission says, what the engine's compile says): a TreeShape / TreeDFA, or the error."""
    args = {kind: text, **({"end_token_id": 3} if kind == "token_trie" else {})}
    outcomes = []
    for side in (lambda r: admit(r, V, None), lambda r: r.compile(V)):
        TreeDFA.cache_clear()  # a cached tree is not checked against the limits again
        try:
            outcomes.append(side(request(**args)))
        except ValueError as err:
            outcomes.append(err)
    return outcomes


@pytest.mark.parametrize("kind", list(BOUNDARY_TREES))
@pytest.mark.parametrize("limit", list(LIMIT_ENV))
@pytest.mark.parametrize("over", [-1, 0, 1])  # the tree's size minus the limit
def test_admission_and_compile_agree_at_every_limit(monkeypatch, kind, limit, over):
    """limit - 1 and the limit itself: admitted and compiled; limit + 1: refused by both, with the
    same TreeTooLarge message (the engine never refuses what admission let through, HTTP 500)."""
    text, sizes = BOUNDARY_TREES[kind]
    size = len(text.encode()) if limit == "bytes" else sizes[limit]
    monkeypatch.setenv(LIMIT_ENV[limit], str(size - over))
    admitted, compiled = _both_sides(kind, text)
    if over <= 0:
        assert not isinstance(admitted, Exception), admitted
        assert not isinstance(compiled, Exception), compiled
        if limit != "bytes":
            assert getattr(admitted, limit) == size
        assert compiled.stats()["nodes"] <= sizes["nodes"] and compiled.stats()["max_depth"] == sizes["depth"]
    else:
        assert isinstance(admitted, TreeTooLarge) or "is too large" in str(admitted), admitted
        assert isinstance(compiled, ValueError), compiled
        assert str(admitted) == str(compiled)
        assert f"is {size} " in str(admitted) and f"over the limit of {size - 1} " in str(admitted)


def test_a_trie_of_exactly_max_nodes_leaf_tokens_is_refused_at_admission(monkeypatch):
    """Issue 30's 500: as many leaf tokens as LOGITGATE_TREE_MAX_NODES passed admission (the root
    not counted) and failed the engine's compile (the root counted). Both count the root now."""
    leaves = [{"name": str(t), "tokens": [t]} for t in range(4, 14)]  # 10 leaf tokens: 11 nodes compiled
    text = json.dumps({"descriptors": [{"leaves": leaves}]})
    monkeypatch.setenv("LOGITGATE_TREE_MAX_NODES", "10")
    admitted, compiled = _both_sides("token_trie", text)
    assert "its node count is 11 nodes, over the limit of 10 nodes" in str(admitted)
    assert str(compiled) == str(admitted)
    monkeypatch.setenv("LOGITGATE_TREE_MAX_NODES", "11")
    admitted, compiled = _both_sides("token_trie", text)
    assert admitted.nodes == 11 and compiled.stats()["nodes"] == 11


# ---- admission off the event loop (issue 30, item 6) -------------------------------------------


def large_trie(leaves: int = 4000, bad_token: int | None = None) -> str:
    """A token trie's text above INLINE_MAX_BYTES (parsed in the admission process)."""
    rows = [{"name": f"leaf{i}", "tokens": [4 + (i + j) % 50 for j in range(6)]} for i in range(leaves)]
    if bad_token is not None:
        rows[-1]["tokens"][-1] = bad_token
    return json.dumps({"modelId": "m", "descriptors": [{"path": "p", "leaves": rows}]})


def test_a_large_tree_is_parsed_in_the_admission_process(monkeypatch):
    """Above INLINE_MAX_BYTES the parse runs in the admission process, never in this one, with the
    outcome a parse here would give: the shape, or the same message for a bad tree."""
    from logitgate.integrations.vllm.tree import admission as tree_admission

    text, bad = large_trie(), large_trie(bad_token=V)
    assert len(text) > tree_admission.INLINE_MAX_BYTES
    expected = admit(request(token_trie=text, end_token_id=3), V, None)
    with pytest.raises(ValueError) as inline:
        admit(request(token_trie=bad, end_token_id=3), V, None)
    tree_admission._admitted_cache().clear()
    monkeypatch.setattr(tree_shape, "_shape", lambda *args: pytest.fail("parsed in the front end's process"))
    assert admit(request(token_trie=text, end_token_id=3), V, None) == expected == (None, 3, 1 + 4000 * 6, 6)
    with pytest.raises(ValueError) as child:
        admit(request(token_trie=bad, end_token_id=3), V, None)
    assert str(child.value) == str(inline.value) and f"token {V} at position 5 is >= vocab_size {V}" in str(child.value)


def test_an_admission_process_that_ends_fails_that_parse_alone(tmp_path):
    """Killed mid-parse (here while it waits on a FIFO): that parse is a ValueError saying so; the
    next one starts a new process."""
    import os
    import threading
    import time
    from pathlib import Path

    from logitgate.integrations.vllm.tree import admission_process as tree_admission_process
    from logitgate.integrations.vllm.tree.admission import Job
    from logitgate.structured.tree.limits import TreeLimits

    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    job = Job("token_trie", Path(fifo), None, None, 3, V, TreeLimits())
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(pytest.raises(ValueError, tree_admission_process.parse_in_process, job)))
    waiting.start()
    for _ in range(600):  # the process starts (it imports logitgate's loaders) and opens the FIFO
        child = tree_admission_process._process._child
        if child is not None and any(os.path.realpath(f"/proc/{child.pid}/fd/{fd}") == str(fifo)
                                     for fd in os.listdir(f"/proc/{child.pid}/fd")):
            break
        time.sleep(0.1)
    child.kill()
    waiting.join(30)
    assert "logitgate's tree admission process ended (exit status -9)" in str(outcome[0].value)
    text = large_trie(leaves=3000)
    assert tree_admission_process.parse_in_process(Job("token_trie", text.encode(), None, None, 3, V, TreeLimits())).nodes == 1 + 3000 * 6


def test_admission_ahead_is_handed_to_process_inputs():
    """`admission` (awaited before vLLM's process_inputs) admits on a worker thread; within
    `handed_over`, process_inputs' own `admit` of the same tree returns that outcome, errors
    included, and parses anew only for another tree, end token, vocabulary or limits."""
    import asyncio
    import threading

    from logitgate.integrations.vllm.tree import admission as tree_admission

    parsed_on = []
    real = tree_admission._admit

    def counting(*args):
        parsed_on.append(threading.current_thread() is threading.main_thread())
        return real(*args)

    good, bad = request(tree_decode=json.dumps(CONFIG)), request(tree_decode=json.dumps({**CONFIG, "prefix_dict": {"40": [V]}}))

    async def scenario():
        ready = await tree_admission.admission(good, V, None)
        refused = await tree_admission.admission(bad, V, None)
        with tree_admission.handed_over(ready):
            assert admit(good, V, None) == ready.shape == (40, 2, 3, 2)
            admit(request(tree_decode=json.dumps(CONFIG) + " "), V, None)  # another text: parsed here
        with tree_admission.handed_over(refused):
            with pytest.raises(ValueError) as err:
                admit(bad, V, None)
            assert str(err.value) == str(refused.error) and str(err.value).startswith("extra_args['tree_decode']: prefix_dict key")
            assert refused.error.__traceback__ is None  # the admission keeps no frame (they hold the tree text)
        assert await tree_admission.admission(request(token_trie=json.dumps(TRIE)), V, None) is None  # no end token

    tree_admission._admitted_cache().clear()
    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as m:
        m.setattr(tree_admission, "_admit", counting)
        asyncio.run(scenario())
    assert parsed_on == [False, False, True], parsed_on  # the two ahead on worker threads, the other text here


def test_the_admission_and_its_process_share_the_parse_core_without_a_circle():
    """The parse core (TreeShape, Job, parse_job) is structured/tree/shape.py's: the admission
    process imports it and nothing of admission.py (at the top or in a function), so the child
    unpickles shape.Job; admission.py uses the process one way only."""
    import ast
    from pathlib import Path

    from logitgate.integrations.vllm.tree import admission as tree_admission
    from logitgate.integrations.vllm.tree import admission_process as tree_admission_process

    def imported(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
                names.update("." * node.level + alias.name for alias in node.names if not node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return names

    process_imports = imported(tree_admission_process)
    assert not {".admission", "logitgate.integrations.vllm.tree.admission"} & process_imports, process_imports
    assert "....structured.tree.shape" in process_imports and "....structured.tree.shape" in imported(tree_admission)
    assert tree_admission.Job is tree_admission_process.Job is tree_shape.Job
    assert tree_admission.parse_job is tree_shape.parse_job and tree_admission.TreeShape is tree_shape.TreeShape


def test_the_heaps_are_trimmed_once_after_the_last_large_admission(monkeypatch):
    """Issue 36.5: large texts admitted one after another lead to one malloc_trim, TRIM_AFTER_S
    after the last (on a worker thread); small ones to none."""
    import asyncio
    import threading

    from logitgate.integrations.vllm.tree import admission as tree_admission

    trims = []
    monkeypatch.setattr(tree_admission, "TRIM_AFTER_S", (0.2,))
    monkeypatch.setattr(tree_admission, "_trimmed", lambda: trims.append(threading.current_thread() is threading.main_thread()))

    async def scenario():
        await tree_admission.admission(request(tree_decode=json.dumps(CONFIG)), V, None)
        await asyncio.sleep(0.4)
        assert trims == []  # a small tree: nothing to give back
        for leaves in (3000, 3001):
            shape = await tree_admission.admission(request(token_trie=large_trie(leaves), end_token_id=3), V, None)
            assert shape.error is None
        await asyncio.sleep(0.6)

    asyncio.run(scenario())
    assert trims == [False]  # once, off the event loop's thread
