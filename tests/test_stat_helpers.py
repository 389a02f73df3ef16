import pytest

from tests.helpers.stat_helpers import chisquare_pvalue_torch


@pytest.mark.parametrize(
    "observed, expected",
    [([10, 20, 30], [20, 20, 20]), ([101, 99, 100, 100], [100, 100, 100, 100]), ([5, 50, 45], [10, 40, 50])],
)
def test_torch_fallback_matches_scipy(observed, expected):
    stats = pytest.importorskip("scipy.stats")
    assert chisquare_pvalue_torch(observed, expected) == pytest.approx(stats.chisquare(observed, expected).pvalue, rel=1e-9, abs=1e-300)
