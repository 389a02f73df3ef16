"""Fuzz test in the spirit of vLLM's logits-processor correctness test: a persistent batch with
random removals, additions (reusing the lowest freed row), condensing moves and swaps every step;
each processor's output, row by row, must equal a per-request reference computed from that
request's parameters and tokens alone — at the current position and, under speculative decoding,
at every draft position."""
import random

import pytest
import torch

from logitgate.sampling import SamplingParams
from logitgate.sampling.processors import (
    BatchUpdateBuilder,
    LogitBias,
    LogitsProcessors,
    MinP,
    MinTokens,
    MoveDirectionality,
    MultiSeq,
    ThinkMode,
    Tree,
)
from tests.helpers.persistent_batch import PersistentBatch
from tests.helpers.rtp_reference import RtpStringTreeDFA, SequenceTrieModel  # the tree semantics, from first principles

V = 32
EOS = 1
BEGIN = 2
END_SEQ = [3, 4, 5]
MARKER = 4
STOPS = [6, 7]
NEG_INF = float("-inf")


# ---- per-request references: what each processor does to one row, from first principles ----


def ref_min_p(row, params, prompt, tokens):
    if not params.min_p:
        return row
    probs = row.softmax(-1)
    return row.masked_fill(probs < probs.max() * params.min_p, NEG_INF)


def ref_logit_bias(row, params, prompt, tokens):
    row = row.clone()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    return row


def ref_min_tokens(row, params, prompt, tokens):
    stops = params.all_stop_token_ids(EOS)
    row = row.clone()
    if len(tokens) < params.min_tokens:
        row[sorted(stops)] = NEG_INF
    return row


def only(row, token):
    out = torch.full_like(row, NEG_INF)
    out[token] = 0.0
    return out


def ref_multiseq(row, params, prompt, tokens):
    stops = params.all_stop_token_ids(EOS)
    return only(row, EOS) if any(t in stops for t in tokens) else row


def longest_partial_end(text):
    for length in range(min(len(END_SEQ), len(text)), 0, -1):
        if text[-length:] == END_SEQ[:length]:
            return length
    return 0


def ref_thinkmode(row, params, prompt, tokens):
    budget = params.max_thinking_tokens
    if budget is None:
        return row
    begins = [i for i, t in enumerate(prompt) if t == BEGIN]
    ends = [i for i, t in enumerate(prompt) if t == MARKER]
    text, spent = [], 0
    if not begins:
        phase = "before"
    elif ends and ends[-1] > begins[-1]:
        phase = "after"
    else:
        phase, text = "thinking", list(prompt[begins[-1] + 1 :])
    for t in tokens:
        if phase == "before":
            if t == BEGIN:
                phase, text, spent = "thinking", [], 0
        elif phase == "thinking":
            forcing = spent >= budget
            spent += 1
            text.append(t)
            if longest_partial_end(text) == len(END_SEQ) or (t == MARKER and not forcing):
                phase = "after"
    row = row.clone()
    if phase == "thinking" and spent >= budget:
        return only(row, END_SEQ[longest_partial_end(text)])
    if phase != "thinking":
        row[MARKER] = NEG_INF
    if phase != "before":
        row[BEGIN] = NEG_INF
    return row


# Trees over the small vocabulary: two prefix dicts (one a JSON string: a different cache key, the
# same tree) and a token trie ending in EOS. Tokens 8..15 so that random picks hit them often.
PREFIX_DICT = {"start_token_id": 31, "end_token_id": EOS, "prefix_dict": {
    "31": [8, 9], "31_8": [10, 11], "31_8_10": [EOS], "31_8_11": [12], "31_9": [], "31_8_11_12": [8, 13]}}
OTHER_PREFIX_DICT = {"start_token_id": 30, "end_token_id": 7, "prefix_dict": {"30": [12, 13, 14], "30_13": [15]}}
TRIE_SEQUENCES = [[8, 9], [8, 9, 10], [12]]
TRIE = {"modelId": "fuzz", "descriptors": [{"path": "p", "leaves": [{"name": str(i), "tokens": s} for i, s in enumerate(TRIE_SEQUENCES)]}]}


def random_tree_args(rng: random.Random) -> dict | None:
    return rng.choice([
        None,
        None,
        {"tree_decode": PREFIX_DICT},
        {"tree_decode": OTHER_PREFIX_DICT},
        {"token_trie": TRIE, "end_token_id": EOS, "token_trie_path": "p"},
    ])


def ref_tree(row, params, prompt, tokens):
    args = params.extra_args
    if not args:
        return row
    if "tree_decode" in args:
        config = args["tree_decode"]
        model = RtpStringTreeDFA(config["prefix_dict"], config["start_token_id"], config["end_token_id"])
    else:
        model = SequenceTrieModel(TRIE_SEQUENCES, args["end_token_id"])
    for t in tokens:
        model.next(t)
    out = torch.full_like(row, NEG_INF)
    allowed = model.candidates()
    out[allowed] = row[allowed]
    return out


def make_processors():
    return {
        "MinP": (MinP(), ref_min_p),
        "LogitBias": (LogitBias(V), ref_logit_bias),
        "MinTokens": (MinTokens(V, eos_token_id=EOS), ref_min_tokens),
        "MultiSeq": (MultiSeq(V, eos_token_id=EOS), ref_multiseq),
        "ThinkMode": (ThinkMode(V, end_think_token_ids=END_SEQ, end_think_token_id=MARKER, begin_think_token_id=BEGIN), ref_thinkmode),
        "Tree": (Tree(V), ref_tree),
    }


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.2
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.5, 1.0]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        logit_bias=rng.choice([None, {rng.randrange(V): rng.uniform(-5, 5) for _ in range(rng.randint(1, 3))}]),
        min_tokens=rng.choice([0, 0, 2, 5]),
        stop_token_ids=rng.sample(STOPS, rng.randint(0, 2)),
        ignore_eos=rng.random() < 0.2,
        max_tokens=None,
        max_thinking_tokens=rng.choice([None, 0, 1, 3, 6]),
        extra_args=random_tree_args(rng),
    )


def random_prompt(rng: random.Random) -> list[int]:
    prompt = [rng.randrange(8, V) for _ in range(rng.randint(0, 4))]
    shape = rng.random()
    if shape < 0.3:
        prompt += [BEGIN] + rng.choice([[], [3], [9, 3, 4]])  # thinking opened (or closed) by the template
    return prompt


def new_request(rng: random.Random) -> dict:
    request = {"params": random_params(rng), "prompt": random_prompt(rng), "output": []}
    if rng.random() < 0.2:  # a resumed request arrives with tokens already generated
        request["output"] = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
    return request


def pick_token(rng: random.Random, *processed_rows: torch.Tensor) -> int:
    """The argmax of one processor's output (so constrained paths get deep), or any token."""
    if rng.random() < 0.7:
        return int(rng.choice(processed_rows).argmax())
    return rng.choice([EOS, BEGIN, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, rng.randrange(V)])


@pytest.mark.parametrize("seed", range(8))
def test_processors_follow_a_shuffled_persistent_batch(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = PersistentBatch(rng, new_request, BatchUpdateBuilder(), MoveDirectionality)
    processors = make_processors()
    together = LogitsProcessors([MinP(), LogitBias(V), MinTokens(V, eos_token_id=EOS), MultiSeq(V, eos_token_id=EOS)])
    checked_spec = 0
    for step in range(30):
        update = batch.step_changes()
        for processor, _ in processors.values():
            processor.update_state(update)
        together.update_state(update)
        if batch.size == 0:
            continue
        logits = torch.randn(batch.size, V) * 3
        for name, (processor, reference) in processors.items():
            got = processor.apply(logits.clone())
            for row, request in enumerate(batch.slots):
                expected = reference(logits[row], request["params"], request["prompt"], request["output"])
                assert torch.equal(got[row], expected), f"{name}, step {step}, row {row}, request {request['id']}"

        # Speculative decoding: random drafts; each draft position sees the tokens before it.
        drafts = [[rng.choice([EOS, BEGIN, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, rng.randrange(V)]) for _ in range(rng.randint(0, 3))] for _ in batch.slots]
        counts = [len(d) for d in drafts]
        target = torch.randn(sum(counts) + len(counts), V) * 3
        for name, (processor, reference) in processors.items():
            got = processor.apply_with_spec_decode(target.clone(), counts, drafts)
            row = 0
            for request, request_drafts in zip(batch.slots, drafts):
                for j in range(len(request_drafts) + 1):
                    tokens = request["output"] + request_drafts[:j]
                    expected = reference(target[row], request["params"], request["prompt"], tokens)
                    assert torch.equal(got[row], expected), f"{name} spec, step {step}, request {request['id']}, position {j}"
                    row += 1
            checked_spec += 1

        # The collection applies every processor: non-argmax-invariant first, then MinP.
        combined = logits.clone()
        for processor in together.non_argmax_invariant + together.argmax_invariant:
            combined = processor.apply(combined)
        think, tree = (processors[name][0].apply(logits.clone()) for name in ("ThinkMode", "Tree"))
        for row, request in enumerate(batch.slots):
            expected = logits[row]
            for ref in (ref_logit_bias, ref_min_tokens, ref_multiseq, ref_min_p):
                expected = ref(expected, request["params"], request["prompt"], request["output"])
            assert torch.equal(combined[row], expected)
            request["output"].append(pick_token(rng, think[row], tree[row]))
    assert checked_spec > 0
