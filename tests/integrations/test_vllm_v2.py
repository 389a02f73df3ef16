"""Tree decode against vLLM's real Model Runner V2 logits-processor interface
(`vllm.v1.worker.gpu.sample.logits_processor`: its LogitsProcessor ABC, LogitsProcRequestState,
LogitsContext, its FQCN loader, processor builder and params validator), with the per-step
contexts a V2 runner builds, from CPU tensors: requests in changing batch order, one row per draft
plus the bonus row, drafts the tree rejects, greedy and sampled rows, the last sampled token
committed or not yet (async scheduling), finished requests' slots recycled for new requests."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from logitgate import TreeDFA

v2 = pytest.importorskip("vllm.v1.worker.gpu.sample.logits_processor")
from vllm import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor import loader as v2_loader  # noqa: E402

V = 48
EOS = 2
MAX_REQS, MAX_LEN = 4, 40
CONFIG = {"start_token_id": 40, "end_token_id": EOS, "prefix_dict": {
    "40": [10, 11, 12], "40_10": [13], "40_10_13": [14, 15], "40_11": [], "40_12": [16], "40_12_16": [17, 18],
    "40_12_16_17": [EOS], "40_12_16_18": [19], "40_12_16_18_19": [EOS]}}
TRIE = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [
    {"name": "x", "tokens": [20, 21]}, {"name": "y", "tokens": [20, 22, 23]}]}]}
FQCN = "logitgate.integrations.vllm:TreeDecode"
NEG_INF = float("-inf")


def request_states():
    """LogitsProcRequestState over CPU tensors, with the attributes the runner's buffers expose
    (StagedWriteTensor.gpu, UvaBackedTensor.np / .gpu)."""
    all_token_ids = torch.zeros(MAX_REQS, MAX_LEN, dtype=torch.int32)
    prompt_len = np.zeros(MAX_REQS, dtype=np.int32)
    total_len = torch.zeros(MAX_REQS, dtype=torch.int32)
    return v2.LogitsProcRequestState(
        device=torch.device("cpu"), max_num_reqs=MAX_REQS, vocab_size=V,
        all_token_ids=SimpleNamespace(gpu=all_token_ids),
        prompt_len=SimpleNamespace(np=prompt_len, gpu=torch.from_numpy(prompt_len)),
        prefill_len=SimpleNamespace(np=prompt_len.copy(), gpu=torch.from_numpy(prompt_len.copy())),
        total_len=SimpleNamespace(gpu=total_len),
    )


def vllm_config():
    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: V))


def allowed(row):
    return torch.nonzero(row > NEG_INF).flatten().tolist()


@pytest.fixture
def processor():
    states = request_states()
    [cls] = v2_loader._load_v2_logitsprocs_by_fqcns([FQCN])
    return cls(vllm_config(), states), states


def test_one_name_loads_in_both_runners():
    from vllm.v1.sample import logits_processor as v1

    from logitgate.integrations.vllm import TreeDecode, TreeDecodeLogitsProcessor, TreeDecodeLogitsProcessorV2

    assert v2_loader._load_v2_logitsprocs_by_fqcns([FQCN]) == [TreeDecode]
    assert v1._load_logitsprocs_by_fqcns([FQCN]) == [TreeDecode]
    runner_state = SimpleNamespace(**{f: getattr(request_states(), f) for f in (
        "device", "max_num_reqs", "vocab_size", "all_token_ids", "prompt_len", "prefill_len", "total_len")})
    [built] = v2_loader.build_custom_logits_processors(vllm_config(), runner_state, False, [FQCN])
    assert type(built) is TreeDecodeLogitsProcessorV2 and isinstance(built, v2.LogitsProcessor)
    v1_built = TreeDecode(vllm_config(), torch.device("cpu"), False)
    assert type(v1_built) is TreeDecodeLogitsProcessor and isinstance(v1_built, v1.LogitsProcessor)
    validate = v2_loader.build_custom_logits_processors_params_validator([FQCN])
    validate(SamplingParams(extra_args={"tree_decode": CONFIG}))
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="end_token_id"):
        validate(SamplingParams(extra_args={"tree_decode": {"start_token_id": 40, "prefix_dict": {}}}))
    with pytest.raises(VLLMValidationError, match="paths are not accepted"):
        validate(SamplingParams(extra_args={"tree_decode": "/etc/passwd"}))


def test_add_request_reports_which_requests_it_modifies(processor):
    proc, _ = processor
    assert proc.add_request(0, SamplingParams(extra_args={"tree_decode": CONFIG}))
    assert not proc.add_request(1, SamplingParams())
    assert proc.add_request(2, SamplingParams(extra_args={"token_trie": json.dumps(TRIE), "end_token_id": EOS}))
    with pytest.raises(ValueError, match=f"{V + 5}"):
        proc.add_request(3, SamplingParams(extra_args={"tree_decode": {**CONFIG, "prefix_dict": {"40": [V + 5]}}}))
    assert not proc.add_request(0, SamplingParams())  # a recycled slot forgets its previous request
    assert 0 not in proc._slots


class Engine:
    """The part of a V2 runner the processor sees: slots, committed tokens, per-step contexts."""

    def __init__(self, rng, states, proc):
        self.rng, self.states, self.proc = rng, states, proc
        self.tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=V)
        self.trie = TreeDFA.from_token_trie(TRIE, end_token_id=EOS, vocab_size=V)
        self.requests: dict[int, dict] = {}
        self.finished = 0

    def admit(self, slot):
        kind = self.rng.choice(["tree", "trie", "none"])
        args = {"tree": {"tree_decode": CONFIG}, "trie": {"token_trie": TRIE, "end_token_id": EOS}, "none": None}[kind]
        prompt = [self.rng.randrange(3, 30) for _ in range(self.rng.randint(0, 3))] + [40]
        self.requests[slot] = {"kind": kind, "prompt": prompt, "output": [], "greedy": self.rng.random() < 0.5,
                               "written": 0}
        assert self.proc.add_request(slot, SamplingParams(extra_args=args)) == (kind != "none")
        self.states.prompt_len.np[slot] = len(prompt)
        self.states.all_token_ids.gpu[slot, : len(prompt)] = torch.tensor(prompt)

    def commit(self, slot):
        """Write committed tokens to all_token_ids; the last sampled one only sometimes (async)."""
        req = self.requests[slot]
        seq = req["prompt"] + req["output"]
        upto = len(seq) if self.rng.random() < 0.5 else len(seq) - 1
        self.states.all_token_ids.gpu[slot, :upto] = torch.tensor(seq[:upto])
        self.states.all_token_ids.gpu[slot, upto:] = V - 1  # stale data the processor must not read
        self.states.total_len.gpu[slot] = upto

    def expected_tree(self, kind):
        return {"tree": self.tree, "trie": self.trie}.get(kind)

    def drafts_for(self, req):
        tree = self.expected_tree(req["kind"]) or self.tree
        drafts, state = [], tree.walk(req["output"])
        for _ in range(self.rng.randint(0, 3)):
            options = tree.allowed(state)
            token = self.rng.choice(options) if self.rng.random() < 0.7 else self.rng.randrange(V)
            drafts.append(token)
            state = tree.step(state, token)
        return drafts

    def step(self):
        order = list(self.requests)
        self.rng.shuffle(order)
        rows, local, pos, input_ids, layout = [], [], [], [], []
        for slot in order:
            req = self.requests[slot]
            self.commit(slot)
            seq = req["prompt"] + req["output"]
            drafts = self.drafts_for(req) if req["output"] else []
            pos0 = len(seq) - 1
            layout.append((slot, len(rows), drafts))
            for j, token in enumerate([seq[-1], *drafts]):
                rows.append(slot)
                local.append(j)
                pos.append(pos0 + j)
                input_ids.append(token)
        ctx = v2.LogitsContext(
            expanded_idx_mapping=torch.tensor(rows, dtype=torch.int32),
            idx_mapping=torch.tensor(order, dtype=torch.int32), idx_mapping_np=np.array(order, dtype=np.int32),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32), input_ids=torch.tensor(input_ids, dtype=torch.int32),
            pos=torch.tensor(pos, dtype=torch.int64), seq_lens_upper_bound_np=np.array(pos, dtype=np.int32) + 1,
        )
        # Seeded from the engine's rng, so the walk (and how many rows it checks) is the same every run.
        logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        got = self.proc.apply(logits.clone(), ctx)
        checked = 0
        for slot, first, drafts in layout:
            req = self.requests[slot]
            tree = self.expected_tree(req["kind"])
            for j in range(len(drafts) + 1):
                row = first + j
                if tree is None:
                    assert torch.equal(got[row], logits[row])
                    continue
                want = tree.allowed(tree.walk(req["output"] + drafts[:j]))
                assert allowed(got[row]) == want, (req, drafts, j)
                assert torch.equal(got[row, want], logits[row, want])
                checked += 1
            self.verify(slot, got[first : first + len(drafts) + 1], drafts)
        return checked

    def verify(self, slot, rows, drafts):
        """Greedy or sampled verification of the drafts against the processed rows."""
        req = self.requests[slot]
        for j, draft in enumerate([*drafts, None]):
            if req["greedy"]:
                token = int(rows[j].argmax())
            else:
                token = int(torch.multinomial(torch.softmax(rows[j], -1), 1, generator=torch.Generator().manual_seed(
                    self.rng.randrange(2**31))))
            req["output"].append(token)
            if token != draft:
                break
        tree = self.expected_tree(req["kind"])
        done = EOS in req["output"] or len(req["prompt"]) + len(req["output"]) + 4 >= MAX_LEN
        if tree is not None and EOS in req["output"]:
            assert tree.is_finished(tree.walk(req["output"][: req["output"].index(EOS) + 1]))
        if done:
            self.finished += 1
            self.admit(slot)  # the finished request's slot goes to a new one


def test_rows_follow_committed_tokens_drafts_and_recycled_slots(processor):
    proc, states = processor
    engine = Engine(random.Random(11), states, proc)
    for slot in range(MAX_REQS):
        engine.admit(slot)
    checked = sum(engine.step() for _ in range(120))
    assert checked > 150 and engine.finished > 10


def test_requests_are_left_to_the_structured_output_route_where_the_plugin_installed_it(processor, monkeypatch):
    from logitgate.integrations.vllm.tree import route as tree_route

    proc, _ = processor
    monkeypatch.setattr(tree_route, "is_installed", lambda: True)
    assert not proc.add_request(0, SamplingParams(extra_args={"tree_decode": CONFIG}))


def test_the_v1_class_also_leaves_tree_requests_to_the_route(monkeypatch):
    from vllm.v1.sample import logits_processor as v1

    from logitgate.integrations.vllm import TreeDecode
    from logitgate.integrations.vllm.tree import route as tree_route

    proc = TreeDecode(vllm_config(), torch.device("cpu"), False)
    monkeypatch.setattr(tree_route, "is_installed", lambda: True)
    builder = v1.BatchUpdateBuilder()
    builder.added.append((0, SamplingParams(extra_args={"tree_decode": CONFIG}), [40], []))
    proc.update_state(builder.get_and_reset(1))
    assert torch.equal(proc.apply(torch.zeros(1, V)), torch.zeros(1, V))
    monkeypatch.setattr(tree_route, "is_installed", lambda: False)
    builder.added.append((1, SamplingParams(extra_args={"tree_decode": CONFIG}), [40], []))
    proc.update_state(builder.get_and_reset(2))
    assert allowed(proc.apply(torch.zeros(2, V))[1]) == [10, 11, 12]
