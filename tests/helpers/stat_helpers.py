"""Chi-square goodness of fit without requiring scipy: the GPU check's hosts have torch but not
always scipy (its wheel alone would exceed the wheel folder's budget), and the p-value is the
regularised upper incomplete gamma function, which torch has."""
from __future__ import annotations

from collections.abc import Sequence


def chisquare_pvalue(observed: Sequence[float], expected: Sequence[float]) -> float:
    """p-value of Pearson's chi-square test (len - 1 degrees of freedom), as scipy.stats.chisquare."""
    observed, expected = [float(x) for x in observed], [float(x) for x in expected]
    total, expected_total = sum(observed), sum(expected)
    if expected_total > 0 and abs(total - expected_total) <= 1e-6 * expected_total:
        # Expected counts computed in float32 miss the total by rounding, which scipy (>= 1.17)
        # refuses beyond 1.5e-8: rescaled. A real difference in totals still fails there.
        expected = [x * total / expected_total for x in expected]
    try:
        from scipy import stats
    except ImportError:
        return chisquare_pvalue_torch(observed, expected)
    return float(stats.chisquare(observed, expected).pvalue)


def chisquare_pvalue_torch(observed: Sequence[float], expected: Sequence[float]) -> float:
    import torch

    obs = torch.as_tensor(list(observed), dtype=torch.float64)
    exp = torch.as_tensor(list(expected), dtype=torch.float64)
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))
