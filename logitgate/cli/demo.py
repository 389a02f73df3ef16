"""`logitgate demo`: the library end to end on a real (tiny) model, in seconds on a CPU.

It decodes a few prompts with the reference decode loop (`logitgate.generate`) under each
configuration of CONFIGS — unconstrained (why constraints matter), tree-constrained greedy and
sampled, the same with speculative decoding and jump-forward (forced tokens), and a JSON schema
through xgrammar — checks that every constrained output is valid, and reports per configuration the
forward passes, acceptance rate, forced tokens and the per-step cost of masking and sampling.

The default model is the embedded byte-level pair (`logitgate.models`) with the catalog of IANA
time-zone names and its prefix-dict tree. `tree=` replaces the tree by a user's RTP-LLM prefix dict;
`model=` loads a local Hugging Face model and tokenizer instead (`draft_model=` optionally adds a
draft; without one speculative decoding uses n-gram prompt-lookup drafts).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..backends import ENV_VAR, get_backend
from ..backends.cpu import threads as cpu_threads
from ..checks import is_integer
from ..decode.generate import GenerationResult, Request, generate
from ..models import demo_prompt, demo_tokenizer, load_catalog, load_demo_models, load_tree_config
from ..sampling.params import SamplingParams
from ..structured.manager import StructuredOutputManager
from ..structured.params import StructuredOutputsParams
from ..structured.tree import TreeDFA
from ..structured.tree.loaders import load_json, parse_prefix_dict

logger = logging.getLogger(__name__)

# Hints: regions the model knows, then cities missing from the catalog, for which the unconstrained
# model invents names. QUICK_HINTS keeps one of each kind.
HINTS = ("Europe", "Asia", "Krakow", "Seattle", "Geneva", "Dallas", "Hanoi")
QUICK_HINTS = ("Europe", "Krakow", "Seattle")
JSON_HINTS = ("Europe", "Krakow", "Hanoi")
QUICK_JSON_HINTS = ("Krakow",)

# The demo's JSON schema. The string pattern and the integer range bound every output, so each
# run ends within JSON_MAX_TOKENS without max_tokens cutting a document short.
ZONE_PATTERN = r"[A-Z][a-z]{1,9}/[A-Za-z_]{1,12}"
OFFSET_RANGE = (-12, 14)
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "pattern": f"^{ZONE_PATTERN}$"},
        "utc_offset_hours": {"type": "integer", "minimum": OFFSET_RANGE[0], "maximum": OFFSET_RANGE[1]},
    },
    "required": ["zone", "utc_offset_hours"],
    "additionalProperties": False,
}
NAME_MAX_TOKENS = 48  # catalog names are at most 32 bytes
JSON_MAX_TOKENS = 72
NUM_SPECULATIVE_TOKENS = 4
NGRAM = 2  # prompt-lookup n when a --model has no draft
SAMPLING_TEMPERATURE = 1.0
# Prompt of a --model without --tree: names in the prompt give n-gram drafts something to find.
MODEL_PROMPT = (
    "IANA time zones: Europe/Berlin, Europe/Warsaw, Europe/Zurich, Asia/Ho_Chi_Minh, Asia/Tokyo, "
    "America/Chicago, America/Los_Angeles, America/New_York.\nThe time zone of {hint} is "
)


@dataclass(frozen=True)
class RunConfig:
    """One row of the demo: a constraint, a sampling mode and a drafting mode."""

    name: str
    constraint: str  # "none", "tree" or "json"
    temperature: float
    speculative: bool = False
    jump_forward: bool = False
    baseline: str | None = None  # the plain run with the same constraint and sampling mode


CONFIGS: tuple[RunConfig, ...] = (
    RunConfig("free greedy", "none", 0.0),
    RunConfig("tree greedy", "tree", 0.0),
    RunConfig("tree greedy + spec", "tree", 0.0, speculative=True, baseline="tree greedy"),
    RunConfig("tree greedy + jump-fwd", "tree", 0.0, jump_forward=True, baseline="tree greedy"),
    RunConfig("tree greedy + spec + jump-fwd", "tree", 0.0, True, True, baseline="tree greedy"),
    RunConfig("tree sampled", "tree", SAMPLING_TEMPERATURE),
    RunConfig("tree sampled + spec", "tree", SAMPLING_TEMPERATURE, speculative=True, baseline="tree sampled"),
    RunConfig("tree sampled + spec + jump-fwd", "tree", SAMPLING_TEMPERATURE, True, True, baseline="tree sampled"),
    RunConfig("json greedy (xgrammar)", "json", 0.0),
)


@dataclass
class DemoSetup:
    """The models, tokenizer functions, prompts and constraints a demo run uses."""

    model_name: str
    target: Any
    draft: Any | None
    decode: Callable[[Sequence[int]], str]
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    tree: TreeDFA
    tree_source: str
    catalog: frozenset[str] | None  # the names the tree spells, when known (checked by decoding)
    prompts: dict[str, list[int]]  # hint -> prompt ids (tree and free runs)
    json_prompts: dict[str, list[int]]
    tokenizer_info: Any  # xgrammar.TokenizerInfo
    device: torch.device


# --------------------------------------------------------------------------------------------
# set-up


@contextmanager
def demo_environment(device: str | None, threads: int | None) -> Iterator[None]:
    """Route CPU tensors to the chosen backend (npu-emulated works on CPU tensors: the decode loop's
    ops pick their backend from LOGITGATE_DEVICE), set the torch and numba thread counts, silence
    transformers' progress bars and warnings; restore everything afterwards."""
    import numba
    import transformers

    hf_logging = transformers.utils.logging
    saved_env = os.environ.get(ENV_VAR)
    saved_threads = torch.get_num_threads(), numba.get_num_threads(), cpu_threads._cap
    saved_verbosity = hf_logging.get_verbosity()
    saved_bars = hf_logging.is_progress_bar_enabled()
    if device is not None:
        os.environ[ENV_VAR] = device
    if threads is not None:
        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        cpu_threads.set_thread_cap(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_env
        torch.set_num_threads(saved_threads[0])
        numba.set_num_threads(saved_threads[1])
        cpu_threads.set_thread_cap(saved_threads[2])
        hf_logging.set_verbosity(saved_verbosity)
        if saved_bars:
            hf_logging.enable_progress_bar()


def load_user_tree(path: str | Path, *, vocab_size: int, backend: Any, model_name: str) -> tuple[TreeDFA, int]:
    """A user's RTP-LLM prefix-dict file compiled for the model: (tree, start token id). A missing
    or malformed file, and token ids outside the model's vocabulary, raise a ValueError naming the
    file (and the key, the token and the vocabulary)."""
    where = f"--tree {str(path)!r}"
    try:
        obj, _ = load_json(Path(path), "prefix dict config")
        parse_prefix_dict(obj)  # the structure first, so that vocabulary errors can say so
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    try:
        tree = TreeDFA.from_prefix_dict(obj, vocab_size=vocab_size, device=backend)
    except ValueError as exc:
        raise ValueError(
            f"{where}: its token ids do not fit {model_name} (vocabulary of {vocab_size} tokens, "
            f"ids 0..{vocab_size - 1}): {exc}"
        ) from None
    return tree, int(tree.stats()["start_token_id"])


def _embedded_setup(backend: Any, tree_path: str | None, quick: bool) -> DemoSetup:
    import xgrammar

    tok = demo_tokenizer()
    model_name = "the embedded byte-level demo model (bytes 0-255, <bos> 256, <eos> 257, <pad> 258, <root> 259)"
    if tree_path is None:
        tree = TreeDFA.from_prefix_dict(load_tree_config(), vocab_size=tok.vocab_size, device=backend)
        start, source = tok.root_token_id, "the embedded catalog of IANA time-zone names"
        catalog = frozenset(load_catalog())
    else:  # before loading the models: a bad file fails at once
        tree, start = load_user_tree(tree_path, vocab_size=tok.vocab_size, backend=backend, model_name=model_name)
        source, catalog = str(tree_path), None
    target, draft = load_demo_models(device=backend.device)

    def prompt(hint: str) -> list[int]:
        # RTP-LLM starts the tree at the last prompt token: the tree's start token ends the prompt.
        return [*demo_prompt(hint)[:-1], start]

    hints = QUICK_HINTS if quick else HINTS
    info = xgrammar.TokenizerInfo(
        tok.token_bytes(), xgrammar.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id]
    )
    return DemoSetup(
        model_name="embedded byte-level target (4 layers) + draft (2 layers)",
        target=target,
        draft=draft,
        decode=tok.decode,
        vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tree=tree,
        tree_source=source,
        catalog=catalog,
        prompts={h: prompt(h) for h in hints},
        json_prompts={h: demo_prompt(h) for h in (QUICK_JSON_HINTS if quick else JSON_HINTS)},
        tokenizer_info=info,
        device=backend.device,
    )


def _model_setup(backend: Any, model_dir: str, draft_dir: str | None, tree_path: str | None, quick: bool) -> DemoSetup:
    """A local Hugging Face model (and optional draft) with its tokenizer, offline."""
    import xgrammar
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path: str, what: str) -> Any:
        if not Path(path).is_dir():
            raise ValueError(f"{what} {path!r} is not a directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{what} {path!r} is not a loadable Hugging Face causal LM: {exc}") from None
        return model.to(backend.device).eval()

    target = load(model_dir, "--model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model_dir!r} has no loadable tokenizer: {exc}") from None
    draft = load(draft_dir, "--draft-model") if draft_dir is not None else None
    vocab = int(target.get_output_embeddings().weight.shape[0])
    if draft is not None and int(draft.get_output_embeddings().weight.shape[0]) != vocab:
        raise ValueError(f"--draft-model {draft_dir!r} has another vocabulary size than --model {model_dir!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--model {model_dir!r}: the tokenizer has no eos_token_id")
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    hints = QUICK_HINTS if quick else HINTS
    prompts = {h: list(tokenizer.encode(MODEL_PROMPT.format(hint=h))) for h in hints}
    if tree_path is None:
        names = load_catalog()
        tree = TreeDFA.from_strings(names, encode, end_token_id=eos, vocab_size=vocab, device=backend)
        source = "the embedded catalog of IANA time-zone names, tokenized with the model's tokenizer"
        catalog = frozenset(names)
    else:
        tree, start = load_user_tree(tree_path, vocab_size=vocab, backend=backend, model_name=f"--model {model_dir!r}")
        source, catalog = str(tree_path), None
        prompts = {h: p if p[-1] == start else [*p, start] for h, p in prompts.items()}
    json_hints = QUICK_JSON_HINTS if quick else JSON_HINTS
    return DemoSetup(
        model_name=f"{model_dir} ({type(target).__name__})" + (f" + draft {draft_dir}" if draft is not None else ""),
        target=target,
        draft=draft,
        decode=decode,
        vocab_size=vocab,
        eos_token_id=eos,
        pad_token_id=pad,
        tree=tree,
        tree_source=source,
        catalog=catalog,
        prompts=prompts,
        json_prompts={h: list(tokenizer.encode(MODEL_PROMPT.format(hint=h) + "JSON: ")) for h in json_hints},
        tokenizer_info=xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab),
        device=backend.device,
    )


# --------------------------------------------------------------------------------------------
# checks


def tree_output_check(tree: TreeDFA, token_ids: Sequence[int]) -> bool:
    """True when `token_ids` is a complete path of the tree: no token leaves it, the end token ends it
    (and nothing follows it)."""
    state = tree.root
    try:
        for token in token_ids:
            if tree.is_finished(state):  # a token after the end token: not a path of the tree
                return False
            state = tree.step(state, token)
            if state == tree.error_state:
                return False
    except ValueError:  # a token id outside the tree's vocabulary
        return False
    return tree.is_finished(state)


def json_output_problem(text: str) -> str | None:
    """Why `text` is not a JSON object matching JSON_SCHEMA (checked by hand), or None when it is."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg}"
    if not isinstance(obj, dict):
        return f"not an object: {type(obj).__name__}"
    expected = sorted(JSON_SCHEMA["properties"])
    if sorted(obj) != expected:
        return f"keys {sorted(obj)} are not exactly {expected}"
    zone, offset = obj["zone"], obj["utc_offset_hours"]
    if not isinstance(zone, str) or not re.fullmatch(ZONE_PATTERN, zone):
        return f"zone {zone!r} is not a string matching {ZONE_PATTERN}"
    low, high = OFFSET_RANGE
    if not is_integer(offset) or not low <= offset <= high:
        return f"utc_offset_hours {offset!r} is not an integer in [{low}, {high}]"
    return None


# --------------------------------------------------------------------------------------------
# runs


def _requests(
    setup: DemoSetup, config: RunConfig, seed: int, limit: int | None, max_tokens: int | None
) -> tuple[list[str], list[Request]]:
    prompts = setup.json_prompts if config.constraint == "json" else setup.prompts
    hints = list(prompts)[:limit] if limit is not None else list(prompts)
    requests = []
    for i, hint in enumerate(hints):
        structured = None
        if config.constraint == "json":
            structured = StructuredOutputsParams(json=JSON_SCHEMA, disable_any_whitespace=True)
        params = SamplingParams(
            temperature=config.temperature,
            seed=seed + i if config.temperature > 0 else None,
            max_tokens=max_tokens or (JSON_MAX_TOKENS if config.constraint == "json" else NAME_MAX_TOKENS),
            structured_outputs=structured,
        )
        requests.append(Request(prompts[hint], params, tree=setup.tree if config.constraint == "tree" else None))
    return hints, requests


def _generate(
    setup: DemoSetup, config: RunConfig, manager: StructuredOutputManager, seed: int,
    limit: int | None = None, max_tokens: int | None = None,
) -> tuple[list[str], GenerationResult, float]:
    hints, requests = _requests(setup, config, seed, limit, max_tokens)
    spec = config.speculative
    start = time.perf_counter()
    result = generate(
        setup.target,
        requests,
        eos_token_id=setup.eos_token_id,
        pad_token_id=setup.pad_token_id,
        draft_model=setup.draft if spec else None,
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS if spec else 0,
        ngram=NGRAM if spec and setup.draft is None else None,
        jump_forward=config.jump_forward,
        manager=manager,
        device=setup.device,
    )
    return hints, result, time.perf_counter() - start


def _describe(setup: DemoSetup, config: RunConfig) -> str:
    parts = ["unconstrained" if config.constraint == "none" else
             "catalog tree" if config.constraint == "tree" else "JSON schema via xgrammar"]
    parts.append("greedy" if config.temperature == 0 else f"sampled, T={config.temperature}")
    if config.speculative:
        drafter = "draft model" if setup.draft is not None else f"n-gram prompt lookup n={NGRAM}"
        parts.append(f"speculative, {drafter}, k={NUM_SPECULATIVE_TOKENS}")
    if config.jump_forward:
        parts.append("forced tokens as drafts")
    return "; ".join(parts)


def _output_record(setup: DemoSetup, config: RunConfig, hint: str, out: Any) -> dict[str, Any]:
    text = setup.decode(out.token_ids)
    record: dict[str, Any] = {"hint": hint, "text": text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
    if config.constraint == "json":
        problem = json_output_problem(text)
        record.update(valid=problem is None, problem=problem)
    else:
        in_tree = tree_output_check(setup.tree, out.token_ids)
        in_catalog = text in setup.catalog if setup.catalog is not None else None
        record.update(in_tree=in_tree, in_catalog=in_catalog)
        if config.constraint == "tree":
            record["valid"] = in_tree and in_catalog is not False
    return record


def _metrics(stats: dict[str, Any], wall: float, baseline: dict[str, Any] | None) -> dict[str, Any]:
    seconds = stats["seconds"]
    steps = max(stats["steps"], 1)
    masking = seconds.get("masking", 0.0)
    sampling = seconds.get("sampling", 0.0) + seconds.get("verification", 0.0)
    fused = seconds.get("tree_step", 0.0)  # tree rows masked, sampled and verified in one sparse step
    saved = None
    if baseline is not None:
        saved = baseline["target_forward_passes"] - stats["target_forward_passes"]
    return {
        "wall_seconds": wall,
        "forward_passes_saved": saved,
        "forward_passes_saved_share": saved / baseline["target_forward_passes"] if saved is not None else None,
        "step_ms": 1000 * wall / steps,
        "masking_ms_per_step": 1000 * masking / steps,
        "sampling_ms_per_step": 1000 * sampling / steps,  # sampling the bonus token + verifying the drafts
        "tree_step_ms_per_step": 1000 * fused / steps,
        "overhead_share": (masking + sampling + fused) / wall if wall > 0 else 0.0,
    }


def _run_record(
    setup: DemoSetup, config: RunConfig, hints: list[str], result: GenerationResult, wall: float,
    earlier: list[dict[str, Any]],
) -> dict[str, Any]:
    stats = result.stats.as_dict()
    baseline = next((r["stats"] for r in earlier if r["name"] == config.baseline), None)
    return {
        "name": config.name,
        "description": _describe(setup, config),
        "constraint": config.constraint,
        "temperature": config.temperature,
        "speculative": config.speculative,
        "jump_forward": config.jump_forward,
        "baseline": config.baseline,
        "outputs": [_output_record(setup, config, hints[o.request_index], o) for o in result.outputs],
        "stats": stats,
        "metrics": _metrics(stats, wall, baseline),
    }


def run_demo(
    *,
    device: str | None = None,
    tree: str | None = None,
    model: str | None = None,
    draft_model: str | None = None,
    quick: bool = False,
    seed: int = 0,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every configuration of CONFIGS and return the report (JSON-serialisable): setup, runs with
    their outputs and statistics, the validity check and timings. `threads` (torch and numba) defaults
    to 1 for the embedded model — its matrices and batches are tiny, so more threads only add
    synchronisation, which costs 3-10x per step on a shared 2-core machine — and for a --model to the
    idle cores (safe_thread_count: all cores fall off a cliff on a loaded host). `progress(line)`
    receives a line per phase (loading, warm-up, each run) with the seconds since the start."""
    if draft_model is not None and model is None:
        raise ValueError("--draft-model needs --model (the embedded model brings its own draft)")
    started = time.perf_counter()
    say = _phase_reporter(progress, started)
    backend = get_backend(device)
    if threads is None:
        threads = 1 if model is None else cpu_threads.safe_thread_count()
    with demo_environment(device, threads):
        say(f"loading {'the embedded models' if model is None else repr(model)} and the tree on {backend.name} "
            f"({threads} thread{'s' if threads != 1 else ''})")
        if model is None:
            setup = _embedded_setup(backend, tree, quick)
        else:
            setup = _model_setup(backend, model, draft_model, tree, quick)
        loaded = time.perf_counter()
        say(f"loaded in {loaded - started:.1f} s; warm-up: numba kernels (compiled on a first run, then cached), "
            "the JSON schema, one short run per configuration")
        manager = StructuredOutputManager(
            setup.tokenizer_info, vocab_size=setup.vocab_size, num_speculative_tokens=NUM_SPECULATIVE_TOKENS
        )
        try:
            # Warm-up: a few steps of every configuration load the numba kernels, compile the JSON
            # schema and settle torch's allocator, so the timings below are steady-state steps.
            for config in CONFIGS:
                _generate(setup, config, manager, seed, limit=1, max_tokens=3)
            warmed = time.perf_counter()
            say(f"warm-up done in {warmed - loaded:.1f} s")
            runs: list[dict[str, Any]] = []
            for i, config in enumerate(CONFIGS):
                hints, result, wall = _generate(setup, config, manager, seed)
                runs.append(_run_record(setup, config, hints, result, wall, runs))
                say(f"run {i + 1}/{len(CONFIGS)} {config.name}: {len(hints)} prompts in {wall:.1f} s")
        finally:
            manager.close()
        finished = time.perf_counter()
    return {
        "device": backend.name,
        "torch_device": str(setup.device),
        "model": setup.model_name,
        "vocab_size": setup.vocab_size,
        "tree": {
            "source": setup.tree_source,
            **{k: setup.tree.stats()[k] for k in ("nodes", "max_depth", "max_width")},
            "catalog_names": len(setup.catalog) if setup.catalog is not None else None,
        },
        "json_schema": JSON_SCHEMA,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "drafter": "draft model" if setup.draft is not None else f"n-gram prompt lookup (n={NGRAM})",
        "quick": quick,
        "seed": seed,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "runs": runs,
        "check": _check(runs),
        "seconds": {
            "load": loaded - started, "warmup": warmed - loaded, "runs": finished - warmed, "total": finished - started
        },
    }


def _phase_reporter(progress: Callable[[str], None] | None, started: float) -> Callable[[str], None]:
    """progress(line) with the seconds since the start, or nothing (the library never prints)."""
    if progress is None:
        return lambda message: None
    return lambda message: progress(f"[demo {time.perf_counter() - started:5.1f} s] {message}")


def _check(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every constrained output valid; greedy speculative runs reproduce plain greedy exactly."""
    constrained = [(r["name"], o) for r in runs if r["constraint"] != "none" for o in r["outputs"]]
    invalid = [{"run": name, "hint": o["hint"], "text": o["text"], "problem": o.get("problem")}
               for name, o in constrained if not o["valid"]]
    free = [o for r in runs if r["constraint"] == "none" for o in r["outputs"]]
    by_name = {r["name"]: r for r in runs}
    greedy_matches = {}
    for r in runs:
        base = by_name.get(r["baseline"]) if r["baseline"] else None
        if base is not None and r["temperature"] == 0:
            same = [o["token_ids"] for o in r["outputs"]] == [o["token_ids"] for o in base["outputs"]]
            greedy_matches[r["name"]] = same
    return {
        # The demo's verdict (exit status 1 when False): valid outputs, and greedy outputs that
        # drafts and forced tokens did not change.
        "ok": not invalid and all(greedy_matches.values()),
        "constrained_outputs": len(constrained),
        "tree_outputs": sum(1 for name, _ in constrained if by_name[name]["constraint"] == "tree"),
        "json_outputs": sum(1 for name, _ in constrained if by_name[name]["constraint"] == "json"),
        "valid": len(constrained) - len(invalid),
        "all_constrained_valid": not invalid,
        "invalid": invalid,
        "unconstrained_outputs": len(free),
        "unconstrained_invalid": sum(1 for o in free if not o["in_tree"] or o["in_catalog"] is False),
        "greedy_speculative_matches_plain": greedy_matches,
    }
