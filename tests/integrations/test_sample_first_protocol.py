"""sample_first's protocol (integrations/vllm/sample_first/protocol.py): the one module for what
crosses between its scheduler side and its worker side. The two sides import it, never each other
(whatever process each runs in, the worker must not need the scheduler's code), the bitmask and the
report survive the pickling that carries them across processes, and every attribute the protocol
names on vLLM's objects is a row of the patch table. Without vLLM."""
from __future__ import annotations

import ast
import pickle
from pathlib import Path

import numpy as np
import pytest

from logitgate.integrations.vllm import fill_ahead, patches
from logitgate.integrations.vllm.sample_first import protocol

PACKAGE = Path(protocol.__file__).parent
SCHEDULER_SIDE = {"scheduler", "policy"}
WORKER_SIDE = {"worker", "mirror", "redraw"}


def _sibling_imports(path: Path, plugin: Path = PACKAGE.parent) -> set[str]:
    """The modules of the vLLM plugin (folder `plugin`) `path` imports, by the name after
    `integrations.vllm.` (`sample_first.scheduler`, `fill_ahead`), at the top or inside a function."""
    here = path.relative_to(plugin).parts[:-1]  # () for the plugin's root, ("sample_first",)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - node.level + 1]) + (node.module.split(".") if node.module else [])
            if node.module:
                found.add(".".join(base))
            else:  # `from . import x`: x may be a module of the package
                found.update(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("logitgate.integrations.vllm."):
            found.add(node.module.removeprefix("logitgate.integrations.vllm."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("logitgate.integrations.vllm.") for a in node.names
                         if a.name.startswith("logitgate.integrations.vllm."))
    return found


@pytest.mark.parametrize("side,other", [(WORKER_SIDE, SCHEDULER_SIDE), (SCHEDULER_SIDE, WORKER_SIDE)],
                         ids=["worker side", "scheduler side"])
def test_each_side_imports_the_protocol_never_the_other_side(side, other):
    for name in side:
        imports = _sibling_imports(PACKAGE / f"{name}.py")
        crossing = sorted(i for i in imports if i.removeprefix("sample_first.") in other)
        assert not crossing, f"sample_first/{name}.py imports {crossing}: what crosses belongs in protocol.py"
    assert "sample_first.protocol" in _sibling_imports(PACKAGE / "worker.py")
    assert "sample_first.protocol" in _sibling_imports(PACKAGE / "scheduler.py")


def test_the_worker_side_borrows_no_thread_pool_from_fill_ahead():
    """The worker's fill threads have one home (fill_threads.py); both operations size their pools
    by the one count of usable cores (logitgate/cores.py)."""
    assert "fill_ahead" not in _sibling_imports(PACKAGE / "redraw.py")
    assert "fill_threads" in _sibling_imports(PACKAGE / "redraw.py")
    for module in (PACKAGE / "redraw.py", Path(fill_ahead.__file__), PACKAGE.parent / "fill_threads.py"):
        assert "from ....cores import usable_cores" in module.read_text() or \
            "from ...cores import usable_cores" in module.read_text(), module


def test_the_scan_sees_a_crossing_import(tmp_path):
    """The scan above is not blind: a module importing the scheduler is caught, however written."""
    folder = tmp_path / "sample_first"
    folder.mkdir()
    (folder / "worker.py").write_text("from .scheduler import REPORT\nfrom . import scheduler\n"
                                      "import logitgate.integrations.vllm.sample_first.scheduler\n")
    assert _sibling_imports(folder / "worker.py", tmp_path) == {"sample_first.scheduler"}


def test_the_bitmask_carries_its_rows_across_processes_and_slices_do_not():
    bitmask = np.full((3, 2), -1, dtype=np.int32)
    rows = protocol.DeferredRows.wrap(bitmask, {"r1": (None, 0.7, 4, (5, 6))}, {"r2": "guidance"})
    back = pickle.loads(pickle.dumps(rows))
    assert isinstance(back, protocol.DeferredRows) and np.array_equal(back, bitmask)
    assert back.deferred == {"r1": (None, 0.7, 4, (5, 6))} and back.mirror == {"r2": "guidance"}
    assert rows[1:].deferred == {} and rows.copy().mirror == {}
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        pickle.dumps(protocol.DeferredRows.wrap(bitmask, {"r1": (lambda: 0, 0.0, 0, ())}))


def test_the_report_pickles_with_its_outcomes():
    report = protocol.Report(mirrors=True, ready=("r1",), failed={"r2": "no"},
                             outcomes={"r1": protocol.Outcome("redrawn", 0.25)})
    assert pickle.loads(pickle.dumps(report)) == report


def test_every_attribute_the_protocol_names_on_vllm_objects_is_a_row():
    rows = {(row.owner_path.rpartition(":")[2], row.attr) for row in patches.PATCHES if row.is_write}
    assert ("ModelRunnerOutput", protocol.REPORT) in rows
    assert ("GPUModelRunner", protocol.DEFERRED_KEY) in rows
    assert ("GPUModelRunner", protocol.MIRRORS_KEY) in rows
