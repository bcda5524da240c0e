"""experiments/offline.py: every offline experiment refuses bad input in one line, before any work."""
import pytest

import audit
import heldout
import mismatch
import scaler


@pytest.mark.parametrize("module, argv, flag", [
    (mismatch, ["--lr", "1"], "--lr"), (audit, ["--batches", "4"], "--batches"),
    (scaler, ["--json", "/proc/cannot/x.json"], "/proc/cannot"), (heldout, ["--init", "/nonexistent"], "--init"),
    (heldout, ["--samples", "0"], "--samples"), (audit, ["--dial-doses", "1"], "--dial-calibration"),
])
def test_experiments_refuse_bad_input_in_one_line(module, argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_every_mode_named_is_one_record_and_agrees_with_its_variant():
    """The modes the offline experiments name are records of offline.MODES, and each fix's
    (engine, trainer) pair computes as its RL variant's flags say (variants.formats)."""
    import fixes
    import growth
    from offline import MODES
    from variants import VARIANTS, formats
    trainers = (mismatch.trainers_of(e, quick) for e in mismatch.ENGINES for quick in (0, 1))
    named = {*mismatch.ENGINES, *growth.LAYER_MODES, *(m for t in trainers for m in t)}
    assert named <= set(MODES), named - set(MODES)
    for variant, (engine, trainer), _ in fixes.FIXES:
        dtype, engine_dtype, lm_head, kernels = formats(VARIANTS[variant].flags)
        assert MODES[trainer] == (dtype, lm_head, kernels), variant
        assert MODES[engine][0] == engine_dtype, variant
