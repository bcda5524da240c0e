"""experiments/results.py: the growth decomposition by hand, a probed policy's figures, and the
refusal of a folder that is not there."""
import pytest

import campaign_figure
import results


def test_growth_decomposition_by_hand():
    """m_t - m_0 = sum (f_t - f_0) s_0 + sum f_t (s_t - s_0), on two buckets, one empty at step 0."""
    rows = [{"pi_bucket_frac": [0.0, 1.0], "pi_bucket_logp_abs_mean": [None, 1e-4]},
            {"pi_bucket_frac": [0.25, 0.75], "pi_bucket_logp_abs_mean": [1e-3, 2e-4]}]
    m = [sum(f * (s or 0) for f, s in zip(r["pi_bucket_frac"], r["pi_bucket_logp_abs_mean"])) for r in rows]
    for r, mt in zip(rows, m):  # what each metrics row holds beside its buckets
        r.update(mismatch_logp_abs_mean=mt, response_len_mean=24, entropy_mean=0.5, logit_rms=3.0)
    results.decompose(rows)
    assert rows[1]["mismatch_shift"] == pytest.approx(-0.25 * 1e-4)
    assert rows[1]["mismatch_within"] == pytest.approx(0.25 * 1e-3 + 0.75 * 1e-4)
    assert rows[1]["mismatch_shift"] + rows[1]["mismatch_within"] == pytest.approx(m[1] - m[0])
    assert rows[0]["mismatch_shift"] == rows[0]["mismatch_within"] == 0
    g = results.growth(rows, None)  # growth's parts are over step 0's mismatch: growth - 1 = within + shift
    assert g["mismatch_growth"] == pytest.approx((m[0] + m[1]) / 2 / m[0])  # the last 10 of two rows: both
    assert g["within"] + g["shift"] == pytest.approx(g["mismatch_growth"] - 1)
    assert g["shift"] == pytest.approx(-0.25 * 1e-4 / 2 / 1e-4)


def test_growth_low_pi_tokens_by_hand():
    """The sampled tokens with pi < 0.9 (the first two buckets): their share of the tokens, last 10 over step 0, and
    their part of the mean mismatch; none for a run with no mismatch (the aligned trainer)."""
    row = lambda frac, size: {"pi_bucket_frac": frac, "pi_bucket_logp_abs_mean": size, "response_len_mean": 24,  # noqa: E731
                              "entropy_mean": 0.5, "logit_rms": 3.0,
                              "mismatch_logp_abs_mean": sum(f * (s or 0) for f, s in zip(frac, size))}
    rows = [row([0.01, 0.0, 0.09, 0.4, 0.5], [1e-2, None, 1e-3, 1e-4, 1e-6]),
            row([0.02, 0.02, 0.06, 0.4, 0.5], [2e-2, 1e-2, 1e-3, 1e-4, 1e-6])]
    results.decompose(rows)
    g = results.growth(rows, None)
    assert g["low_pi_frac_growth"] == pytest.approx((0.01 + 0.04) / 2 / 0.01)
    m1 = 0.02 * 2e-2 + 0.02 * 1e-2 + 0.06 * 1e-3 + 0.4 * 1e-4 + 0.5 * 1e-6
    assert g["low_pi_share"] == pytest.approx((1e-4 / rows[0]["mismatch_logp_abs_mean"] + 6e-4 / m1) / 2)
    zero = [row([0.01, 0.0, 0.09, 0.4, 0.5], [0.0, None, 0.0, 0.0, 0.0])] * 2
    results.decompose(zero)
    assert results.growth(zero, None)["low_pi_share"] is None


def test_a_figure_refuses_a_folder_that_is_not_there(capsys):
    with pytest.raises(SystemExit) as e:
        campaign_figure.main(["/nonexistent", "--out", "x.png"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "/nonexistent" in err, err
