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
