"""The mismatch dial (experiments/dial.py): nothing at dose 0, and above it the engine really samples
from the perturbed distribution whose log-probs it returns."""
import math

import pytest
import torch

import dial
import rollout
import task
from conftest import MAX_LEN, PROMPTS
from model import hf_named_tensors, load_hf, pack, token_logprobs
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


@pytest.mark.parametrize("shape", ["uniform", "bf16"])
def test_the_engine_samples_from_the_distribution_it_reports(dialed, random_ckpt, shape):
    """The aligned trainer's pi is the engine's own unperturbed distribution. Tokens drawn from mu
    give E[log mu - log pi] = KL(mu || pi) > 0; had the engine drawn them from pi and only
    reported mu, the mean would be -KL(pi || mu) < 0. The sign tells which distribution sampled."""
    model = load_hf(random_ckpt)
    rollout.sync_weights(dialed, hf_named_tensors(model), torch.bfloat16)
    dial.configure(1.0, shape, [4.0, 2.0, 1.0, 0.5, 0.25])
    torch.manual_seed(0)
    samples = rollout.generate(dialed, PROMPTS, 8, 24, task.EOS_ID)
    dial.configure(0.0)
    idx, mask, mu = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], "cpu",
                         [s.logprobs for s in samples])
    with torch.no_grad():
        pi = token_logprobs(get_precision("bf16", device="cpu", kernels="engine").logits_fn(model), idx)
    d = ((mu - pi) * mask)[mask.bool()].double()
    se = d.std().item() / math.sqrt(d.numel())
    m = mismatch_metrics(mu, pi, mask)
    assert m["mismatch_logp_abs_mean"] > 0.05  # the dial is on
    assert m["mismatch_k1"] > 4 * se, (m["mismatch_k1"], se)  # drawn from mu
