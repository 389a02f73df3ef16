import pytest

from tests.helpers.sampling_helpers import ALPHA, chi_square_pvalue


@pytest.fixture
def assert_distribution():
    def check(samples, probs):
        pvalue = chi_square_pvalue(samples, probs)
        assert pvalue > ALPHA, f"chi-square p-value {pvalue:.3g} <= {ALPHA}"

    return check
