"""The Sampler: vLLM v1's order, greedy/random rows mixed, per-request generators, logprobs."""
import pytest
import torch

from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams, make_generator
from logitgate.sampling.processors import (
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessors,
    builtin_logits_processors,
)

V = 64


class Recorder(LogitsProcessor):
    """Counts apply() calls; optionally bans one token."""

    def __init__(self, invariant: bool, ban: int | None = None):
        self.invariant, self.ban, self.calls = invariant, ban, 0

    def is_argmax_invariant(self):
        return self.invariant

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        self.calls += 1
        if self.ban is not None:
            logits[:, self.ban] = float("-inf")
        return logits


def metadata_for(params, *, processors=(), generators=None, device="cpu"):
    procs = LogitsProcessors(processors)
    builder = BatchUpdateBuilder()
    for i, p in enumerate(params):
        builder.add(i, p, None, [])
    procs.update_state(builder.get_and_reset(len(params)))
    return SamplingMetadata.from_params(params, device=device, generators=generators, logitsprocs=procs)


def test_greedy_and_random_rows_mix(backend, sampling_variant):
    torch.manual_seed(0)
    logits = (torch.randn(6, V) * 3).to(backend.device)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.8, 0.0, 1e-7)]
    out = Sampler(backend=backend)(logits.clone(), metadata_for(params, device=backend.device))
    tokens = out.sampled_token_ids
    assert tokens.shape == (6, 1) and tokens.dtype == torch.int32
    greedy_rows = [0, 2, 4, 5]  # 1e-7 is below SAMPLING_EPS: greedy too
    assert tokens[greedy_rows, 0].tolist() == logits[greedy_rows].argmax(-1).tolist()
    # Random rows really sample: over many steps they leave the argmax.
    random_draws = [
        Sampler(backend=backend)(logits.clone(), metadata_for(params, device=backend.device)).sampled_token_ids[1, 0].item()
        for _ in range(40)
    ]
    assert len(set(random_draws)) > 1


def test_all_greedy_skips_argmax_invariant_processors_but_not_the_others():
    invariant, changing = Recorder(True), Recorder(False, ban=5)
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0  # the argmax, banned by the non-invariant processor
    params = [SamplingParams(temperature=0.0)] * 2
    out = Sampler()(logits, metadata_for(params, processors=[invariant, changing]))
    assert invariant.calls == 0 and changing.calls == 1
    assert (out.sampled_token_ids != 5).all()
    Sampler()(torch.randn(2, V), metadata_for([SamplingParams(temperature=0.0), SamplingParams()], processors=[invariant, changing]))
    assert invariant.calls == 1 and changing.calls == 2


def test_greedy_rows_ignore_filters_and_never_see_nan():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.5), SamplingParams(top_p=0.01)]
    out = Sampler()(logits.clone(), metadata_for(params))
    # top_k=1 and a tiny top_p leave only the argmax.
    assert out.sampled_token_ids.flatten().tolist() == logits.argmax(-1).tolist()


def test_seeded_requests_are_reproducible(backend, sampling_variant):
    params = [SamplingParams(seed=11), SamplingParams(), SamplingParams(seed=12, top_k=10)]
    logits = torch.randn(3, V).to(backend.device)

    def run():
        generators = {0: make_generator(11, backend.device), 2: make_generator(12, backend.device)}
        steps = []
        for _ in range(3):
            meta = metadata_for(params, generators=generators, device=backend.device)
            steps.append(Sampler(backend=backend)(logits.clone(), meta).sampled_token_ids[[0, 2], 0].tolist())
        return steps

    first, second = run(), run()
    assert first == second
    assert len({tuple(s) for s in first}) > 1 or first[0] != first[1]  # generators advance between steps


def test_prefetched_noise_gives_the_same_tokens(backend, sampling_variant):
    params = [SamplingParams(seed=5), SamplingParams(temperature=0.0), SamplingParams(seed=6, top_p=0.9)]
    logits = torch.randn(3, V).to(backend.device)

    def metadata():
        generators = {0: make_generator(5, backend.device), 2: make_generator(6, backend.device)}
        return metadata_for(params, generators=generators, device=backend.device)

    plain = Sampler(backend=backend)(logits.clone(), metadata())
    meta = metadata()
    meta.prefetch_noise(3, V, backend=backend)
    assert meta.noise is not None and not meta.noise.consumed
    ahead = Sampler(backend=backend)(logits.clone(), meta)
    assert torch.equal(plain.sampled_token_ids, ahead.sampled_token_ids)
    greedy_meta = metadata_for([SamplingParams(temperature=0.0)])
    greedy_meta.prefetch_noise(1, V)
    assert greedy_meta.noise is None  # nothing to draw


def test_logprobs_raw_topn_rank_and_sampled():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(logprobs=1), SamplingParams()]
    out = Sampler()(logits.clone(), metadata_for(params))
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    raw = logits.log_softmax(-1)
    sampled = out.sampled_token_ids.flatten()
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled.long().unsqueeze(1)).squeeze(1))
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:].long(), top.indices)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    expected_rank = (raw > raw.gather(1, sampled.long().unsqueeze(1))).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks, expected_rank)
    assert lp.selected_token_ranks[0] == 1  # greedy picks the top token
    ids, values, ranks = lp.tolists()
    assert len(ids) == 3 and len(values[0]) == 4 and ranks[0] == 1


def test_processed_logprobs_see_the_filters():
    logits = torch.randn(2, V)
    params = [SamplingParams(top_k=2, logprobs=4), SamplingParams(temperature=0.0, logprobs=4)]
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), metadata_for(params))
    lp = out.logprobs_tensors.logprobs
    assert torch.isinf(lp[0, 3:]).all() and torch.isfinite(lp[0, :3]).all()  # only 2 tokens survive top-k
    assert torch.isfinite(lp[1]).all()  # greedy rows are not filtered


def test_no_logprobs_when_not_asked():
    assert Sampler()(torch.randn(2, V), metadata_for([SamplingParams()] * 2)).logprobs_tensors is None


def test_half_precision_logits_are_sampled_in_float32():
    logits = torch.randn(2, V).to(torch.bfloat16)
    out = Sampler()(logits, metadata_for([SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]))
    assert out.sampled_token_ids[0, 0] == logits[0].float().argmax()


def test_builtin_processors_in_the_sampler():
    procs = builtin_logits_processors(V, eos_token_id=0)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}), SamplingParams(temperature=0.0, min_tokens=3)]
    logits = torch.zeros(2, V)
    logits[1, 0] = 50.0  # EOS would win, but min_tokens masks it
    out = Sampler()(logits, metadata_for(params, processors=procs))
    assert out.sampled_token_ids.flatten().tolist()[0] == 7
    assert out.sampled_token_ids.flatten().tolist()[1] != 0


def test_bad_metadata_and_modes():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="raw")
    with pytest.raises(ValueError, match=r"params\[1\] must be a SamplingParams"):
        SamplingMetadata.from_params([SamplingParams(), {"temperature": 1.0}])
    with pytest.raises(ValueError, match=r"generators has row 2, outside \[0, 2\)"):
        SamplingMetadata.from_params([SamplingParams()] * 2, generators={2: make_generator(0)})
    meta = metadata_for([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="temperature must have shape"):
        Sampler()(torch.randn(3, V), meta)


def test_metadata_from_params():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.8, seed=3, logprobs=2), SamplingParams(top_k=7)]
    gens = {0: make_generator(1), 1: make_generator(3)}
    meta = SamplingMetadata.from_params(params, generators=gens)
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_k.tolist() == [0, 5, 7] and meta.max_top_k is None  # the greedy row has no top-k
    assert list(meta.generators) == [1]  # greedy rows never draw
    assert meta.max_num_logprobs == 2
    meta = SamplingMetadata.from_params(params[1:])
    assert meta.all_random and meta.max_top_k == 7
    assert SamplingMetadata.from_params([SamplingParams(temperature=0.0)]).temperature is None
