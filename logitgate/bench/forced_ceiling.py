"""How much of a structured output the constraint fixes, and how many target passes that saves:
the json_writer model's outputs replayed through a fresh xgrammar matcher (issue 37's ceiling).

Outputs: the json_writer model (logitgate/models/json_writer.py, the real Llama-3 tokenizer) under
each served-benchmark schema (json_records.SCHEMAS, compact JSON as vLLM's xgrammar backend writes
it without free whitespace), greedy and at T=1, decoded by logitgate's decode loop
(decode/generate.py) from vLLM-style random prompts. Each output is decoded twice, with forced
drafts (structured/forced.py) and without: greedy outputs must be identical, and the loop's own
passes per token are reported for both.

Replay, per output token (a fresh matcher advanced through the output):
- token_forced_share: tokens the mask allows alone (e.g. EOS once the record is closed);
- string_forced_share: characters inside the grammar's jump-forward string at some point;
- ideal_passes_per_token: an ideal skip appends every token that is mask-forced or lies inside the
  forced string for free, so only the other tokens need a target pass;
- drafting_passes_per_token (per last-token rule, structured/forced.py LAST_TOKEN_RULES): one pass
  per step, each step proposing forced.xgrammar_forced_tokens and accepting their longest prefix
  that matches the output, then one more token; with the drafts' acceptance. Exact in
  distribution at T=1 too: a point-mass draft is emitted exactly when it is accepted.
Baseline: plain decoding, 1 pass per token.

Time (`--rounds R`, `--device`): the decode loop without and with forced drafts, interleaved R
times on the same device, wall-clock seconds per side (medians) and their ratio. The loop has no KV
cache (each pass recomputes the sequence), so on a GPU a tiny model's pass is launch-bound and
roughly costs the same with or without drafts appended: the time saved is the passes saved less
the work of proposing drafts (the grammar's jump-forward string, its tokenization).

    python -m logitgate.bench.forced_ceiling [--prompts 32] [--max-tokens 64] [--rounds 1] [--device cpu] [--out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar as xgr

from logitgate.bench.harness import emit
from logitgate.decode import Request, generate
from logitgate.models.json_records import SCHEMAS, check_text
from logitgate.models.json_writer import json_writer_model
from logitgate.models.json_writer_check import load
from logitgate.models.random_prompts import random_prompts
from logitgate.sampling.params import SamplingParams
from logitgate.structured import StructuredOutputManager, StructuredOutputsParams
from logitgate.structured.forced import LAST_TOKEN_RULES, xgrammar_forced_tokens

MAX_FORCED = 32  # decode/generate.py's MAX_FORCED_TOKENS


def compact_grammar(schema: dict) -> str:
    """The schema as EBNF without free whitespace and with compact separators (vLLM's xgrammar
    backend with disable_any_whitespace)."""
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))


def replay(output: list[int], compiled: xgr.CompiledGrammar, encode, texts: list[str], vocab_size: int) -> dict:
    """Counts for one output (see the module docstring)."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    from logitgate.structured.forced import only_allowed_token

    chars_forced: set[int] = set()
    at, token_forced, skippable = 0, 0, 0
    for token in output:
        piece = texts[token]
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_forced = only_allowed_token(bitmask[0].numpy(), vocab_size) == token
        jump = matcher.find_jump_forward_string()
        chars_forced.update(range(at, at + len(jump)))
        token_forced += mask_forced
        skippable += mask_forced or (bool(piece) and jump.startswith(piece))
        at += len(piece)
        if not matcher.accept_token(token):
            raise AssertionError(f"the grammar refuses token {token} of its own output")
    out = {
        "tokens": len(output), "chars": at, "token_forced": token_forced,
        "string_forced_chars": len(chars_forced & set(range(at))), "ideal_passes": len(output) - skippable,
    }
    for rule in LAST_TOKEN_RULES:
        matcher = xgr.GrammarMatcher(compiled)
        i = passes = proposed = accepted = 0
        while i < len(output):
            forced = xgrammar_forced_tokens(matcher, encode, MAX_FORCED, vocab_size=vocab_size, last_token=rule)
            match = 0
            while match < len(forced.tokens) and i + match < len(output) and forced.tokens[match] == output[i + match]:
                match += 1
            step = min(match + 1, len(output) - i)
            for token in output[i : i + step]:
                assert matcher.accept_token(token)
            passes, proposed, accepted, i = passes + 1, proposed + len(forced.tokens), accepted + match, i + step
        out[rule] = {"passes": passes, "proposed": proposed, "accepted": accepted}
    return out


def decode_all(model, prompts, params, manager, eos, batch, jump_forward, device="cpu"):
    outputs, stats = [], []
    began = time.perf_counter()
    for start in range(0, len(prompts), batch):
        requests = [Request(p, params(start + j)) for j, p in enumerate(prompts[start : start + batch])]
        result = generate(model, requests, eos_token_id=eos, manager=manager, jump_forward=jump_forward, device=device)
        outputs += [o.token_ids for o in result.outputs]
        stats.append(result.stats)
    wall = time.perf_counter() - began  # the loop reads every token on the host: no sync needed
    return outputs, {
        "tokens": sum(s.tokens for s in stats),
        "sequence_steps": sum(s.sequence_steps for s in stats),
        "target_forward_passes": sum(s.target_forward_passes for s in stats),
        "forced_tokens": sum(s.forced_tokens for s in stats),
        "proposed_forced_drafts": sum(s.proposed_forced_drafts for s in stats),
        "accepted_forced_drafts": sum(s.accepted_forced_drafts for s in stats),
        "seconds": sum(sum(s.seconds.values()) for s in stats),
        "wall_seconds": wall,
    }


def timed(model, prompts, params, manager, eos, args) -> tuple[list, dict, list, dict, dict]:
    """Both sides `args.rounds` times, interleaved (plain, forced, plain, ...): the first round's
    outputs and counts, and the median wall-clock seconds of each side with their ratio."""
    walls: dict[str, list[float]] = {"without_forced": [], "with_forced": []}
    first = None
    for _ in range(args.rounds):
        plain_outputs, plain = decode_all(model, prompts, params, manager, eos, args.batch, False, args.device)
        forced_outputs, forced = decode_all(model, prompts, params, manager, eos, args.batch, True, args.device)
        walls["without_forced"].append(plain["wall_seconds"])
        walls["with_forced"].append(forced["wall_seconds"])
        first = first or (plain_outputs, plain, forced_outputs, forced)
    plain_outputs, plain, forced_outputs, forced = first
    medians = {side: statistics.median(w) for side, w in walls.items()}
    timing = {
        "device": str(args.device), "rounds": args.rounds, "wall_seconds": walls,
        "median_wall_seconds": medians,
        "tokens_per_second": {"without_forced": plain["tokens"] / medians["without_forced"],
                              "with_forced": forced["tokens"] / medians["with_forced"]},
        "speedup_with_forced": medians["without_forced"] / medians["with_forced"],
    }
    return plain_outputs, plain, forced_outputs, forced, timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per case")
    parser.add_argument("--device", default="cpu", help="where the model runs and the loop samples (cpu, cuda)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    path = json_writer_model()
    torch.set_grad_enabled(False)
    model, tok = load(path)
    model = model.to(args.device)
    vocab_size = model.config.vocab_size
    eos = model.config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    texts = [tok.decode([t]) for t in range(vocab_size)]
    for t in info.special_token_ids:
        texts[t] = ""
    prompts = random_prompts(tok, args.prompts, seed=0)
    manager = StructuredOutputManager(info, vocab_size=vocab_size, num_speculative_tokens=MAX_FORCED, encode=encode)
    rows = []
    try:
        for name, schema in SCHEMAS.items():
            grammar = compact_grammar(schema)
            compiled = compiler.compile_grammar(grammar)
            for temperature in (float(t) for t in args.temperatures.split(",")):
                def params(i: int, temperature=temperature, grammar=grammar) -> SamplingParams:
                    return SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=args.max_tokens,
                                          structured_outputs=StructuredOutputsParams(grammar=grammar))
                began = time.perf_counter()
                plain_outputs, plain, forced_outputs, forced, timing = timed(model, prompts, params, manager, eos, args)
                if temperature == 0:
                    assert forced_outputs == plain_outputs, "greedy outputs changed with forced drafts"
                counts = [replay(o, compiled, encode, texts, vocab_size) for o in plain_outputs]

                def total(key, rule=None):
                    return sum((c[rule][key] if rule else c[key]) for c in counts)

                tokens, chars = total("tokens"), total("chars")
                valid = sum(check_text(tok.decode(o, skip_special_tokens=True), schema)["valid"] for o in plain_outputs)
                row = {
                    "schema": name, "temperature": temperature, "outputs": len(plain_outputs), "valid_outputs": valid,
                    "tokens": tokens, "chars": chars,
                    "token_forced_share": total("token_forced") / tokens,
                    "string_forced_share": total("string_forced_chars") / chars,
                    "ideal_passes_per_token": total("ideal_passes") / tokens,
                    "drafting": {
                        rule: {
                            "passes_per_token": total("passes", rule) / tokens,
                            "proposed": total("proposed", rule), "accepted": total("accepted", rule),
                            "acceptance": total("accepted", rule) / max(1, total("proposed", rule)),
                        }
                        for rule in LAST_TOKEN_RULES
                    },
                    "decode_loop": {
                        "without_forced": {**plain, "passes_per_token": plain["sequence_steps"] / plain["tokens"]},
                        "with_forced": {**forced, "passes_per_token": forced["sequence_steps"] / forced["tokens"],
                                        "acceptance": forced["accepted_forced_drafts"] / max(1, forced["proposed_forced_drafts"])},
                    },
                    "timing": timing,
                    "seconds": time.perf_counter() - began,
                }
                rows.append(row)
                print(json.dumps({**{k: row[k] for k in ("schema", "temperature", "token_forced_share", "string_forced_share",
                                                         "ideal_passes_per_token")},
                                  "speedup_with_forced": timing["speedup_with_forced"]}), flush=True)
    finally:
        manager.close()
    emit({
        "benchmark": "forced_ceiling", "model": str(path.name), "prompts": args.prompts, "max_tokens": args.max_tokens,
        "device": str(args.device), "device_name": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else "cpu",
        "torch": torch.__version__, "baseline": "plain decoding: 1 target pass per token", "rows": rows,
    }, args.out)


if __name__ == "__main__":
    main()
