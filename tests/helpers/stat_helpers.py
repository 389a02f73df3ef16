"""Chi-square goodness of fit without requiring scipy: the GPU check's hosts have torch but not
always scipy (its wheel alone would exceed the wheel folder's budget), and the p-value is the
regularised upper incomplete gamma function, which torch has."""
from __future__ import annotations

from collections.abc import Sequence


def chisquare_pvalue(observed: Sequence[float], expected: Sequence[float]) -> float:
    """p-value of Pearson's chi-square test (len - 1 degrees of freedom), as scipy.stats.chisquare."""
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
