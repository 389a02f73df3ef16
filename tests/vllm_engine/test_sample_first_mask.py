"""sample_first where the mask itself matters (issue 36, items 1 and 2), on real servers: `vllm
serve` with vLLM's defaults (API server, engine core and worker in processes of their own) on the
json_writer model (logitgate.models.json_writer, the real Llama-3 tokenizer), each grammar backend
with the plugin and without it (VLLM_PLUGINS=, vLLM as shipped); greedy requests must come back
token for token as vLLM's.

- `min_tokens` past where the grammar can end: the grammar allows only the stop token and
  min-tokens bans it; vLLM's MinTokensLogitsProcessor then gives the stop token back to the masked
  row (all -inf otherwise), and vLLM ends the output there. A row sampled before its mask never
  showed the processor the mask: every draw was refused and the row fell to token 0 (xgrammar: the
  scheduler refused it, HTTP 500; llguidance, whose stopped matcher accepts anything: a record with
  `!` after its end). Such rows are filled first.
- llguidance's validate_tokens accepts non-canonical tokenizations its mask excludes: at the forced
  key of `{"ok": ...}` the mask allows the token `ok` alone, validate_tokens `o` too, and the
  json_writer model prefers `o`. Only its mask could check a draw, a fill after the forward pass
  (deferring never costs less): its rows are filled first, and come back token for token as vLLM's.
"""
from __future__ import annotations

import json
import sys

import pytest

from logitgate.bench.served_server import VLLM_CLI, post, running_server
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

# The record's `name` and `age`, then the key `ok`: after `"age":N,"` the json_writer model ranks
# the token `o` about 30th (the candidates a rejected row checks: 32) and `ok` far below.
OK_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                              "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False}
CHOICE = {"choice": ["yes", "no", "maybe"]}
NAME = "json_writer"
PROMPTS = 8  # vLLM's benchmark client's random prompts, which the model was trained after


def cases() -> list[tuple[str, dict]]:
    """(name, request body without the prompt): greedy, the key `ok` over PROMPTS prompts, the
    record over 4, the choice over 2."""
    from logitgate.models.json_records import BOUNDED_SCHEMA

    out = []
    for i in range(PROMPTS):
        out.append((f"ok_key_{i}", {"structured_outputs": {"json": OK_SCHEMA}, "prompt_index": i}))
    for i in range(4):
        out.append((f"record_min_tokens_{i}", {"structured_outputs": {"json": BOUNDED_SCHEMA}, "min_tokens": 40,
                                                "prompt_index": i}))
    for i in range(2):
        out.append((f"choice_min_tokens_{i}", {"structured_outputs": CHOICE, "min_tokens": 6, "prompt_index": i}))
    return out


def serve_cases(tmp_path, backend: str, with_plugin: bool) -> dict[str, tuple[int, list[int] | None, str]]:
    """Each case's (HTTP status, token ids, text) on one server."""
    from logitgate.models.json_writer import json_writer_model
    from logitgate.models.random_prompts import random_prompt_texts
    from logitgate.models.real_vocab import load_tokenizer

    model = str(json_writer_model())
    prompts = random_prompt_texts(load_tokenizer("llama3"), PROMPTS)
    config = json.dumps({"backend": backend, "disable_any_whitespace": True})
    env = {} if with_plugin else {"VLLM_PLUGINS": ""}
    log = tmp_path / f"server_{backend}_{'plugin' if with_plugin else 'vllm'}.log"
    out = {}
    def command(port: int, *extra: str) -> list[str]:  # `vllm serve MODEL` with vLLM's defaults
        return [sys.executable, "-c", VLLM_CLI, "serve", model, "--served-model-name", NAME, "--dtype", "float32",
                "--max-num-seqs", "8", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port), *extra]

    with running_server(log, "--structured-outputs-config", config, command=command, **env) as server:
        for name, body in cases():
            body = dict(body)
            prompt = prompts[body.pop("prompt_index")]
            status, answer = post(f"{server.url}/v1/completions", {
                "model": NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0, "return_token_ids": True, **body})
            choice = answer["choices"][0] if status == 200 else {}
            out[name] = (status, choice.get("token_ids"), choice.get("text", json.dumps(answer)))
        log_text = server.log_text()
    assert "EngineDeadError" not in log_text
    return out


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def served(request, tmp_path_factory):
    """Per backend: the cases with the plugin and with vLLM alone."""
    tmp_path = tmp_path_factory.mktemp(request.param)
    return request.param, serve_cases(tmp_path, request.param, True), serve_cases(tmp_path, request.param, False)


def test_min_tokens_past_the_grammars_end_ends_as_vllm_ends_it(served):
    """Issue 36.1: HTTP 200 and vLLM's tokens; the record ends where the grammar does (no `!`)."""
    backend, plugin, vllm = served
    names = [name for name, _ in cases() if "min_tokens" in name]
    for name in names:
        assert vllm[name][0] == 200, (backend, name, vllm[name])  # vLLM gives the stop token back
        assert plugin[name] == vllm[name], (backend, name, plugin[name], vllm[name])
    records = [json.loads(plugin[name][2]) for name in names if name.startswith("record")]
    assert all(set(record) == {"name", "age", "city", "tags"} for record in records), records


def test_every_token_is_one_vllms_mask_allows(served):
    """Issue 36.2: at the forced key `"ok"` llguidance's mask allows the token `ok` alone; the plugin
    emitted `o`, `k` where vLLM emits `ok` (llguidance's rows are now filled first)."""
    backend, plugin, vllm = served
    ok = [vllm[name] for name, _ in cases() if name.startswith("ok_key")]
    assert all(json.loads(text)["ok"] in (True, False) for _, _, text in ok), ok
    for name in [name for name, _ in cases() if name.startswith("ok_key")]:
        assert vllm[name][0] == 200, (backend, name, vllm[name])
        assert plugin[name] == vllm[name], (backend, name, plugin[name], vllm[name])
