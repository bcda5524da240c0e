"""The mismatch dial (experiments/dial.py): nothing at dose 0, and above it the engine really samples
from the perturbed distribution whose log-probs it returns."""
import json
import math

import pytest
import torch

import dial
import rollout
import task
from conftest import MAX_LEN, PROMPTS
from model import hf_named_tensors, load_hf, logprobs_of, pack
from precision import get_precision, mismatch_metrics


def test_dose_0_installs_nothing():
    assert dial.engine_args(0.0) == {} and dial.sigma_for({"unit": 1e-4, "grid": {}}, "uniform", 0) == 0.0
    dial.configure(0.0)
    logits = torch.randn(3, 7)
    assert dial.DialProcessor(None, "cpu", False).apply(logits) is logits


def test_bf16_shape_scales_each_entry_by_its_bucket_of_pi():
    probs = torch.tensor([[0.2, 0.5, 0.95, 0.995, 0.9995, 1.0]])
    scale = dial.bucket_scale(probs, [10.0, 5.0, 2.0, 1.0, 0.5])
    assert scale.tolist() == [[10.0, 5.0, 2.0, 1.0, 0.5, 0.5]]  # [0, .5), [.5, .9), ... [.999, 1]


def test_sigma_for_interpolates_the_calibration_in_log_log():
    cal = {"unit": 2e-4, "grid": {"uniform": [[1e-2, 1e-4], [1e-1, 1e-3]]}}
    # 3x the unit = 6e-4 per token: between the two grid points, a power law through both
    assert dial.sigma_for(cal, "uniform", 3) == pytest.approx(6e-2)
    with pytest.raises(ValueError, match="outside"):
        dial.sigma_for(cal, "uniform", 100)


@pytest.fixture(scope="session")  # destroying an in-process engine tears down the others
def dialed(random_ckpt):
    return rollout.start_engine(random_ckpt, "bfloat16", 0, MAX_LEN, **dial.engine_args(1.0))


def dialed_samples(dialed, random_ckpt, shape, s):
    """(d = log mu - log pi per token, the mask, the aligned trainer's logits) of the dialed
    engine's samples at setting s; pi is the engine's own unperturbed distribution."""
    model = load_hf(random_ckpt)
    rollout.sync_weights(dialed, hf_named_tensors(model), torch.bfloat16)
    dial.configure(s, shape, [4.0, 2.0, 1.0, 0.5, 0.25])
    torch.manual_seed(0)
    samples = rollout.generate(dialed, PROMPTS, 8, 24, task.EOS_ID)
    dial.configure(0.0)
    idx, mask, mu = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], "cpu",
                         [s.logprobs for s in samples])
    with torch.no_grad():
        logits = get_precision("bf16", device="cpu", kernels="engine").logits_fn(model)(idx[:, :-1])
    return mu, logprobs_of(logits, idx), mask, logits, idx


# temperature: logits x 5, sharper; a random model's near-flat logits, flattened, hardly change
SETTINGS = {"uniform": 1.0, "bf16": 1.0, "temperature": -4.0, "persistent": 1.0}


@pytest.mark.parametrize("shape", list(SETTINGS))
def test_the_engine_samples_from_the_distribution_it_reports(dialed, random_ckpt, shape):
    """The aligned trainer's pi is the engine's own unperturbed distribution. Tokens drawn from mu
    give E[log mu - log pi] = KL(mu || pi) > 0; had the engine drawn them from pi and only
    reported mu, the mean would be -KL(pi || mu) < 0. The sign tells which distribution sampled."""
    mu, pi, mask, _, _ = dialed_samples(dialed, random_ckpt, shape, SETTINGS[shape])
    d = ((mu - pi) * mask)[mask.bool()].double()
    se = d.std().item() / math.sqrt(d.numel())
    m = mismatch_metrics(mu, pi, mask)
    assert m["mismatch_logp_abs_mean"] > 0.05  # the dial is on
    assert m["mismatch_k1"] > 4 * se, (m["mismatch_k1"], se)  # drawn from mu


def test_temperature_is_a_bias_and_persistent_noise_does_not_average_along_a_sequence(dialed, random_ckpt):
    """temperature: d follows h = E_pi[z] - z_y with slope s to first order (a flatter engine:
    likelier tokens lose, rarer gain). persistent: one noise a sequence, so at a std that
    swamps the logits a sequence repeats one token, where fresh noise at each position
    (uniform) draws a new one."""
    mu, pi, mask, logits, idx = dialed_samples(dialed, random_ckpt, "temperature", 0.01)
    z = logits.double()
    h = (torch.softmax(z, -1) * z).sum(-1) - torch.gather(z, -1, idx[:, 1:, None]).squeeze(-1)
    d, h = (mu - pi).double()[mask.bool()], h[mask.bool()]
    assert (d * h).sum() / (h * h).sum() == pytest.approx(0.01, rel=0.1)
    repeats = {}  # at a std far above the logits' spread, the noise picks the token
    for shape in ("uniform", "persistent"):
        _, _, mask, _, idx = dialed_samples(dialed, random_ckpt, shape, 5.0)
        tokens, both = idx[:, 1:], (mask[:, 1:] * mask[:, :-1]).bool()
        repeats[shape] = (tokens[:, 1:] == tokens[:, :-1])[both].double().mean().item()
    assert repeats["persistent"] > 0.3 > 0.05 > repeats["uniform"], repeats  # 0.46, 0.0014 here


def test_extend_measures_only_the_shapes_a_calibration_lacks_and_keeps_the_rest(dialed, random_ckpt, tmp_path,
                                                                                 monkeypatch):
    """A calibration made before a shape existed gains that shape's grid; its unit, profile and
    other grids stay as written, byte for byte. Once it has every shape, --extend refuses."""
    from instruments import machine
    old = {"unit": 1e-3, "profile": [4.0, 2.0, 1.0, 0.5, 0.25], "seed": 0, "machine": machine(),
           "grid": {s: [[0.1, 1e-3], [1.0, 1e-2]] for s in dial.SHAPES if s != "persistent"}}
    path = tmp_path / "dial.json"
    path.write_text(json.dumps(old, indent=1))
    monkeypatch.setattr(dial, "warm_start", lambda *a: random_ckpt)
    monkeypatch.setattr(dial, "start_engine", lambda *a, **k: dialed)  # the suite's one dialed engine
    monkeypatch.setattr(dial, "SIGMAS", (1.0,))
    dial.main(["calibrate", "--extend", "--group-size", "1", "--json", str(path)])
    new = json.loads(path.read_text())
    grid = new["grid"].pop("persistent")
    assert new == old and len(grid) == 1 and grid[0][0] == 1.0 and grid[0][1] > 1e-3
    with pytest.raises(SystemExit) as stop:
        dial.main(["calibrate", "--extend", "--json", str(path)])
    assert stop.value.code == 2 and json.loads(path.read_text())["grid"]["persistent"] == grid


def test_doses_prints_each_shapes_s_and_refuses_a_dose_beyond_the_grid(tmp_path, capsys):
    path = tmp_path / "dial.json"
    path.write_text(json.dumps({"unit": 2e-4, "grid": {"uniform": [[1e-2, 1e-4], [1e-1, 1e-3]]}}))
    dial.main(["doses", "--doses", "3", "--json", str(path)])
    assert capsys.readouterr().out.splitlines()[1].split() == ["uniform", "0.06"]  # as sigma_for's test
    with pytest.raises(SystemExit) as stop:
        dial.main(["doses", "--doses", "100", "--json", str(path)])
    assert stop.value.code == 2 and "outside" in capsys.readouterr().err
