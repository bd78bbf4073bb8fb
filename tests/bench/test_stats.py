"""The statistics behind `bench --base`: Mann-Whitney U against reference values; the verdict."""

from __future__ import annotations

import random
import statistics

import pytest

from flashmoe_science.pipeline.bench import stats

# (x, y, U of x, two-sided p) from scipy 1.17.1's mannwhitneyu(x, y, method="asymptotic"),
# which uses the same normal approximation with tie and continuity corrections.
KNOWN = [
    # the example of scipy's documentation
    ([19, 22, 16, 29, 24], [20, 11, 17, 12], 17.0, 0.11134688653314041),
    # many ties
    ([1, 2, 2, 3, 3, 3, 4], [2, 3, 4, 4, 5, 5, 6, 6], 8.5, 0.025144761173357368),
    # complete separation, 10 a side
    (list(range(10)), [i + 10 for i in range(10)], 0.0, 0.00018267179110955002),
    # the example of R's wilcox.test help page (normal approximation)
    (
        [0.80, 0.83, 1.89, 1.04, 1.45, 1.38, 1.91, 1.64, 0.73, 1.46],
        [1.15, 0.88, 0.90, 0.74, 1.21],
        35.0,
        0.24462360512698333,
    ),
]


@pytest.mark.parametrize(("x", "y", "u", "p"), KNOWN)
def test_mann_whitney_matches_reference_values(x, y, u, p):
    result = stats.mann_whitney_u(x, y)
    assert result.u == u
    assert result.p_value == pytest.approx(p, rel=1e-12)


def test_mann_whitney_is_symmetric_and_handles_all_equal_values():
    x, y = [1.0, 2.5, 3.0, 4.0], [2.0, 5.0, 6.0]
    assert stats.mann_whitney_u(x, y).p_value == pytest.approx(stats.mann_whitney_u(y, x).p_value)
    assert stats.mann_whitney_u([1.0] * 5, [1.0] * 7).p_value == 1.0


def test_quantiles_and_summary_interpolate_like_numpy():
    samples = [5.0, 1.0, 4.0, 2.0, 3.0, 6.0]
    summary = stats.summarize(samples)
    # numpy.percentile([1..6], [25, 50, 75]) == [2.25, 3.5, 4.75]
    assert (summary.q1, summary.median, summary.q3) == (2.25, 3.5, 4.75)
    assert summary.iqr == 2.5
    assert (summary.n, summary.min, summary.max) == (6, 1.0, 6.0)


def test_summary_quartiles_are_the_standard_librarys_inclusive_quantiles():
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 8, 20, 101):
        samples = [rng.lognormvariate(0, 0.3) for _ in range(n)]
        summary = stats.summarize(samples)
        if n == 1:
            assert summary.q1 == summary.median == summary.q3 == samples[0]
            continue
        q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        assert (summary.q1, summary.median, summary.q3) == (q1, median, q3)
        assert summary.median == statistics.median(samples)
        # the "exclusive" default would widen the spread of small samples
        if n >= 3:
            assert statistics.quantiles(samples, n=4)[0] != summary.q1


def _noisy(rng: random.Random, center: float, rel_noise: float, n: int) -> list[float]:
    return [center * (1 + rng.gauss(0, rel_noise)) for _ in range(n)]


def test_clear_ten_percent_slowdown_is_a_regression():
    rng = random.Random(1)
    base, head = _noisy(rng, 1.00, 0.005, 50), _noisy(rng, 1.10, 0.005, 50)
    verdict = stats.decide(base, head)
    assert verdict.verdict == stats.REGRESSION
    assert verdict.ratio == pytest.approx(1.10, abs=0.01)
    assert verdict.p_value < 1e-10


def test_clear_speedup_is_an_improvement():
    rng = random.Random(2)
    verdict = stats.decide(_noisy(rng, 1.0, 0.005, 50), _noisy(rng, 0.8, 0.005, 50))
    assert verdict.verdict == stats.IMPROVEMENT


def test_three_percent_change_under_heavy_noise_is_no_change():
    rng = random.Random(3)
    base, head = _noisy(rng, 1.00, 0.15, 50), _noisy(rng, 1.03, 0.15, 50)
    assert stats.decide(base, head).verdict == stats.NO_CHANGE


def test_significant_but_small_change_is_no_change():
    # p is tiny, but 2% is below the 5% threshold: not worth a red X
    rng = random.Random(4)
    verdict = stats.decide(_noisy(rng, 1.00, 0.001, 50), _noisy(rng, 1.02, 0.001, 50))
    assert verdict.p_value < 1e-6
    assert verdict.verdict == stats.NO_CHANGE


def test_large_but_insignificant_change_is_no_change():
    # medians 10% apart, but the spread is three times the shift: noise, not a regression
    base = [0.7 + 0.06 * i for i in range(11)]
    verdict = stats.decide(base, [x * 1.1 for x in base])
    assert verdict.ratio == pytest.approx(1.1) and verdict.p_value > 0.05
    assert verdict.verdict == stats.NO_CHANGE


def test_identical_samples_are_no_change():
    samples = _noisy(random.Random(5), 1.0, 0.02, 40)
    verdict = stats.decide(samples, list(samples))
    assert verdict.verdict == stats.NO_CHANGE
    assert verdict.ratio == 1.0
    assert verdict.p_value == pytest.approx(1.0, abs=0.01)


def test_too_few_samples_fall_back_to_the_threshold_alone():
    # 3 against 3 can never reach p < 0.01 (as in asv, the factor alone decides then)
    assert stats.smallest_p_value(3, 3) > stats.DEFAULT_ALPHA
    verdict = stats.decide([1.0, 1.01, 0.99], [1.2, 1.21, 1.19])
    assert verdict.p_value is None
    assert verdict.verdict == stats.REGRESSION
    assert verdict.to_dict()["test"] == "threshold-only"


@pytest.mark.parametrize(
    ("median", "iqr", "unstable"),
    [
        (0.0651, 0.12, True),  # the H100 small case a disturbance hit: 184% (10 us in other runs)
        (0.0119, 0.00084, False),  # a ~12 us case's ordinary jitter: 7%
        (1.26, 0.16, False),  # the widest undisturbed spread of that run: 13%
        (0.010, 0.0025, False),  # exactly at the limit: a 10 us case may jitter by 2.5 us
        (0.010, 0.0026, True),
        (0.0, 0.0, True),  # a zero median says nothing
    ],
)
def test_a_timing_is_unstable_when_its_iqr_exceeds_a_quarter_of_its_median(median, iqr, unstable):
    assert stats.UNSTABLE_SPREAD == 0.25
    assert stats.unstable(median, iqr) is unstable
    assert stats.spread(0.0651, 0.12) == pytest.approx(1.843, abs=1e-3)
    assert stats.unstable(0.0119, 0.00084, limit=0.05)  # the limit is a parameter
