"""The one torch reference for every kernel logitgate ships, one module per family:

- bitmask.py    applying a token bitmask to logits
- tree.py       the tree kernels: sparse candidate gather / greedy token / draw / dense keep, bitmask fill
- rejection.py  speculative decoding's rejection sampling
- sampling.py   top-k / top-p, the exact draws

Each backend's kernel is tested against the functions here on random inputs. They favour clarity
over speed and run on any device torch supports; `Backend`'s defaults (backends/base.py) call them
through this package. The formats and rules they are written on (backends/formats.py,
backends/sampling_rules.py) are production code and are re-exported here under their old names.
"""
from __future__ import annotations

from ..formats import (
    BITS_PER_WORD,
    candidate_column_tokens,
    candidate_tokens,
    gather_csr_rows,
    leading_true_counts,
    num_bitmask_words,
    pack_bitmask,
    rejection_output,
    spec_layout,
    unpack_bitmask,
)
from ..sampling_rules import (
    draw_seeds,
    draw_uniforms,
    exponential_race,
    fallback_tokens,
    fill_exponential,
    tempered_logits,
    top_k_disabled,
    top_p_threshold,
    undefined_logit_rows,
    undefined_prob_rows,
)
from .bitmask import apply_token_bitmask_reference
from .rejection import (
    recovery_weights_reference,
    rejection_greedy_accept_reference,
    rejection_random_accept_reference,
    rejection_recover_exponential_reference,
    rejection_recover_inverse_cdf_reference,
    rejection_verify_reference,
)
from .sampling import (
    apply_top_k_top_p_reference,
    inverse_cdf_sample_reference,
    race_sample_reference,
    random_sample_reference,
    sample_from_logits_reference,
)
from .tree import (
    candidate_argmax_reference,
    fill_tree_bitmask_reference,
    gather_candidate_logits_reference,
    keep_candidate_logits_reference,
    sample_candidates_reference,
)

# The output assembly of rejection sampling has no kernel of its own: it is the layout (formats.py).
rejection_output_reference = rejection_output

__all__ = [
    "BITS_PER_WORD",
    "apply_token_bitmask_reference",
    "apply_top_k_top_p_reference",
    "candidate_argmax_reference",
    "candidate_column_tokens",
    "candidate_tokens",
    "draw_seeds",
    "draw_uniforms",
    "exponential_race",
    "fallback_tokens",
    "fill_exponential",
    "fill_tree_bitmask_reference",
    "gather_candidate_logits_reference",
    "gather_csr_rows",
    "inverse_cdf_sample_reference",
    "keep_candidate_logits_reference",
    "leading_true_counts",
    "num_bitmask_words",
    "pack_bitmask",
    "race_sample_reference",
    "random_sample_reference",
    "sample_from_logits_reference",
    "recovery_weights_reference",
    "rejection_greedy_accept_reference",
    "rejection_output",
    "rejection_output_reference",
    "rejection_random_accept_reference",
    "rejection_recover_exponential_reference",
    "rejection_recover_inverse_cdf_reference",
    "rejection_verify_reference",
    "sample_candidates_reference",
    "spec_layout",
    "tempered_logits",
    "top_k_disabled",
    "top_p_threshold",
    "undefined_logit_rows",
    "undefined_prob_rows",
    "unpack_bitmask",
]
