"""experiments/sites.py: the trainer's rounding at the two sites. Each mode's error by hand and
on random values (the docstring's table); trunc equal to vLLM's truncating kernels bit for bit
on the op probe's inputs; rne leaving the trainer bit-identical; the backward a cast's; the warm
start and float32 untouched."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import model
import precision
import sites
from conftest import ROOT
from instruments import machine

UP, X = 1.0078125, 1.005859375  # 1 + 2^-7 (bf16's next value after 1), and 1 + 3 x 2^-9 between


def test_each_mode_by_hand():
    """1 + 3/4 ulp: to nearest goes up, truncation down, away up; at 6 bits (ulp 2^-6) the nearest
    is 1; the same in size for -x; sym takes one of trunc's or away's, by the value."""
    x = torch.tensor([X, -X, 1.0, float("nan"), float("inf")])
    want = {"rne": [UP, -UP, 1.0], "trunc": [1.0, -1.0, 1.0], "away": [UP, -UP, 1.0],
            "rne6": [1.0, -1.0, 1.0]}
    for mode, values in want.items():
        out = sites.round_to_bf16(x, mode)
        assert out.dtype == torch.bfloat16 and out[:3].float().tolist() == values, mode
        assert out[3].isnan() and out[4].isinf()
    between = torch.tensor([1 + 5 * 2 ** -8, -(1 + 5 * 2 ** -8)])  # 2.5 ulp: 1.25 at 6 bits, 0.625 at 5
    assert sites.round_to_bf16(between, "rne6").float().tolist() == [1 + 2 ** -6, -(1 + 2 ** -6)]
    assert sites.round_to_bf16(between, "rne5").float().tolist() == [1 + 2 ** -5, -(1 + 2 ** -5)]
    assert sites.round_to_bf16(x, "rne5").float()[:3].tolist() == [1.0, -1.0, 1.0]
    sym = sites.round_to_bf16(x, "sym").float()[:2].abs().tolist()
    assert all(v in (1.0, UP) for v in sym)
    eighth = 2 ** -10  # 1/8 ulp at 1: 1/8 and 7/8 ulp lie farther than 1/4 from a tie
    far = torch.tensor([1 + eighth, -(1 + eighth), 1 + 7 * eighth])
    assert sites.round_to_bf16(far, "nudge").float().tolist() == [1.0, -1.0, UP]
    assert all(v in (1.0, UP) for v in sites.round_to_bf16(x, "nudge").float()[:2].abs().tolist())
    near = torch.tensor([1 + 3 * eighth, 1 + 5 * eighth])  # 3/8, 5/8 ulp: within 1/4 of the tie
    assert sites.round_to_bf16(near, "nudge16").float().tolist() == [1.0, UP]  # 1/16 is too short
    mid = torch.tensor([1 + 5 * eighth / 2, 1 + 11 * eighth / 2])  # 5/16, 11/16: 3/16 from the tie
    assert sites.round_to_bf16(mid, "nudge8").float().tolist() == [1.0, UP]  # 1/8 is too short
    quarter = torch.tensor([1 + 2 * eighth, 1 + 6 * eighth])  # 1/4, 3/4 ulp: 1/4 from the tie
    assert sites.round_to_bf16(quarter, "nudge3of16").float().tolist() == [1.0, UP]  # too short
    nan_payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    for mode in sites.RULES:  # a payload never carries into the exponent or the sign
        assert sites.round_to_bf16(nan_payloads, mode).isnan().all(), mode


def test_trunc_clears_the_low_16_bits_of_every_kind_of_pattern():
    """The cheap fix's int32 form against NumPy's mask, an independent reference: on 2^22 random
    bit patterns and the edges (signed zeros, subnormals, the largest finite values, infinities,
    NaN payloads of either sign, in the low bits only among them), each value's pattern with its
    low 16 bits cleared; each NaN stays a NaN (cleared, a low payload would be an infinity)."""
    pats = np.random.default_rng(0).integers(0, 2 ** 32, 2 ** 22, dtype=np.uint64)
    edges = [0, 0x80000000, 1, 0x8000FFFF, 0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
             0xFF800000, 0x7F800001, 0xFF80FFFF, 0x7FC00000, 0xFFFFFFFF]
    pats = np.concatenate([pats, edges]).astype(np.uint32)
    nan = np.isnan(pats.view(np.float32))
    out = sites.round_to_bf16(torch.from_numpy(pats.view(np.float32)), "trunc")
    out = out.float().numpy().view(np.uint32)
    assert nan[-4:].all() and (out[~nan] == pats[~nan] & 0xFFFF0000).all()
    assert np.isnan(out.view(np.float32)[nan]).all()


def as_it_was(pats, mode):
    """sites.round_bits's arithmetic as it was before the int32 form, in NumPy on uint64
    patterns: each pattern widened, the adds carried, the result masked to 32 bits (the shares,
    trunc1of2 and trunc1of4, which came after, written the same way). The modes' constants are
    sites.py's; the arithmetic is written again here, not shared."""
    b, low, wide = pats.astype(np.uint64), np.uint64(0xFFFF), np.uint64(2 ** 64 - 1)
    u = np.uint64

    def hashed(b):  # the low 32 bits of the pattern times Knuth's hash
        return (b * u(0x9E3779B1)) & u(0xFFFFFFFF)

    def coin(b):  # its top bit
        return hashed(b) >> u(31) == 1

    def to_nearest(b, drop):
        lsb = (b >> u(drop)) & u(1)
        return (b + u((1 << (drop - 1)) - 1) + lsb) & (wide ^ u((1 << drop) - 1))

    kept = b & (wide ^ low)
    if mode == "trunc":
        b = kept
    elif mode in sites.KEPT:
        b = to_nearest(b, 23 - sites.KEPT[mode])
    elif mode in sites.NUDGE:
        push = u(sites.NUDGE[mode])
        b = to_nearest(np.where(coin(b), b + push, b - push), 16)
    elif mode in sites.STEP:
        step, size = u(sites.STEP[mode]), kept & u(0x7FFFFFFF)
        moves = (size >= step) & (size < u(0x7F800000))
        b = np.where(moves, np.where(coin(b), kept + step, kept - step), kept)
    elif mode in sites.SHARE:  # truncated where the hash's top 16 bits lie below the share
        b = np.where(hashed(b) >> u(16) < u(sites.SHARE[mode]), kept, to_nearest(b, 16))
    else:  # away, sym
        up = (b & low) != 0
        up &= coin(b) if mode == "sym" else True
        b = np.where(up, kept + u(0x10000), kept)
    return (b & u(0xFFFFFFFF)).astype(np.uint32)


def test_every_rule_on_the_int32_pattern_equals_its_wider_arithmetic_and_never_widens():
    """Each rule but rne against as_it_was on 2^22 random bit patterns and the edges (signed
    zeros, subnormals, the largest finite values, infinities, NaN payloads): every value's bits
    equal, every NaN a NaN. And no tensor the rule makes is int64 (the int32 form's price)."""
    pats = np.random.default_rng(2).integers(0, 2 ** 32, 2 ** 22, dtype=np.uint64)
    edges = [0, 0x80000000, 1, 0x80000001, 0x8000FFFF, 0x00008000, 0x80008000, 0x007FFFFF,
             0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF]
    pats = np.concatenate([pats, edges]).astype(np.uint32)
    nan = np.isnan(pats.view(np.float32))
    x = torch.from_numpy(pats.view(np.float32))
    seen = set()

    class Dtypes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.update([out.dtype] if isinstance(out, torch.Tensor) else [])
            return out

    for mode in [m for m in sites.RULES if m != "rne"]:
        with Dtypes():
            out = sites.round_bits(x, mode).numpy().view(np.uint32)
        assert (out[~nan] == as_it_was(pats, mode)[~nan]).all(), mode
        assert np.isnan(out.view(np.float32)[nan]).all(), mode
    assert torch.int32 in seen and torch.int64 not in seen


def test_each_modes_error_has_the_tables_mean_and_mean_abs():
    """On 10^6 random floats spread over magnitudes, in ulps of bf16 at each value: rne 1/4 ulp
    of |error|, every other mode 1/2; trunc shrinks sizes by 1/2 ulp on average, away grows
    them by 1/2, rne6 and sym leave them unbiased; rne5, the size dial, 1 ulp and unbiased;
    nudge, the neutral change, 5/16 and unbiased, a quarter of the values off rne's; its doses,
    nudge8 17/64 (17/16 of rne's), an eighth off, nudge16 65/256 (65/64), a sixteenth off, and
    nudge3of16 73/256 (73/64), 3/16 off, nudge3of8 25/64 (25/16), 3/8 off, and nudge7of16
    113/256 (113/64), 7/16 off; truncation at a share p of the values and rne at the rest,
    -p/2 ulp in size and (1 + p)/4 of |error|, each value one of the two, p/2 off rne's and
    (1 - p)/2 off trunc's: trunc1of2 (p 1/2: -1/4, 3/8) and trunc1of4 (p 1/4: -1/8, 5/16)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 ** 6, generator=g) * torch.exp(2 * torch.randn(10 ** 6, generator=g))
    ulp = torch.pow(2.0, torch.floor(torch.log2(x.abs())) - 7)
    doses = {"nudge": (1 / 4, 5 / 16), "nudge8": (1 / 8, 17 / 64), "nudge16": (1 / 16, 65 / 256),
             "nudge3of16": (3 / 16, 73 / 256), "nudge3of8": (3 / 8, 25 / 64),
             "nudge7of16": (7 / 16, 113 / 256)}  # share, mean |error|
    want = {"rne": (0.0, 0.25), "trunc": (-0.5, 0.5), "away": (0.5, 0.5), "rne6": (0.0, 0.5),
            "sym": (0.0, 0.5), "rne5": (0.0, 1.0), "trunc1of2": (-0.25, 0.375),
            "trunc1of4": (-0.125, 0.3125),
            **{m: (0.0, e) for m, (_, e) in doses.items()}}
    rounded = {mode: sites.round_to_bf16(x, mode) for mode in want}  # each mode once
    error = {}  # each mode's mean |error| in ulp, read again below for nudge's ratios
    for mode, (size, mean_abs) in want.items():
        r = rounded[mode].float()
        error[mode] = ((r - x) / ulp).abs().mean()
        assert ((r.abs() - x.abs()) / ulp).mean().item() == pytest.approx(size, abs=0.01), mode
        assert error[mode].item() == pytest.approx(mean_abs, abs=0.01), mode
    up = rounded["sym"].float().abs() > x.abs()
    assert up.float().mean().item() == pytest.approx(0.5, abs=0.01)  # half each way
    for mode, p in {"trunc1of2": 1 / 2, "trunc1of4": 1 / 4}.items():  # trunc's or rne's
        dosed = rounded[mode]
        assert ((dosed == rounded["trunc"]) | (dosed == rounded["rne"])).all(), mode
        for other, off in (("rne", p / 2), ("trunc", (1 - p) / 2)):
            moved = (dosed != rounded[other]).float().mean().item()
            assert moved == pytest.approx(off, abs=0.005), (mode, other)
    for mode, (share, mean_abs) in doses.items():
        moved = rounded[mode] != rounded["rne"]
        assert moved.float().mean().item() == pytest.approx(share, abs=0.002), mode
        ratio = mean_abs / (1 / 4)  # over rne's, measured on the same values
        assert (error[mode] / error["rne"]).item() == pytest.approx(ratio, abs=0.004), mode



def test_truncpm_keeps_truncations_error_and_adds_a_zero_mean_step():
    """truncpm: truncation's bf16, then 1 ulp up or down in size by the coin (truncpm2: 2 ulp), so
    against a truncating engine's op on the same input a zero-mean step, half each way, and
    against exact values truncation's mean, -1/2 ulp in size, at 1 and 2 ulp of mean |error|
    (a step down from a power of two is shorter: 0.02 of slack). Zero, the smallest values and
    infinities stay truncation's."""
    down = 1 - 2 ** -8  # bf16's value before 1
    x = torch.tensor([X, -X])  # truncates to 1: then 1 + 2^-7 or 1 - 2^-8, by the coin
    assert all(v in (UP, down) for v in sites.round_to_bf16(x, "truncpm").float().abs().tolist())
    edge = torch.tensor([0.0, -0.0, 1e-45, float("inf"), -float("inf")])
    for mode in ("truncpm", "truncpm2"):
        assert torch.equal(sites.round_to_bf16(edge, mode), sites.round_to_bf16(edge, "trunc"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10 ** 6, generator=g) * torch.exp(2 * torch.randn(10 ** 6, generator=g))
    ulp = torch.pow(2.0, torch.floor(torch.log2(x.abs())) - 7)
    trunc = sites.round_to_bf16(x, "trunc").float()
    for mode, step in (("truncpm", 1), ("truncpm2", 2)):
        r = sites.round_to_bf16(x, mode).float()
        step_in_size = (r.abs() - trunc.abs()) / ulp
        assert (step_in_size > 0).float().mean().item() == pytest.approx(0.5, abs=0.01), mode
        assert step_in_size.mean().item() == pytest.approx(0.0, abs=0.02), mode
        assert step_in_size.abs().mean().item() == pytest.approx(step, abs=0.01), mode
        assert ((r.abs() - x.abs()) / ulp).mean().item() == pytest.approx(-0.5, abs=0.02), mode
        assert ((r - x) / ulp).abs().mean().item() == pytest.approx(step, abs=0.01), mode


def test_sym_is_nudges_rule_at_a_push_of_half_an_ulp_off_exact_values(monkeypatch):
    """nudge's rule with a push of 1/2 ulp sends every value the coin's way, as sym does: the
    two agree on every random float not already a bf16 (nudgedose316.md reads sym as that
    dose); on values already a bf16, ties for the push, nudge moves those with an odd last bit."""
    monkeypatch.setitem(sites.NUDGE, "half", 0x8000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10 ** 6, generator=g) * torch.exp(2 * torch.randn(10 ** 6, generator=g))
    x = x[x.to(torch.bfloat16).float() != x]
    assert torch.equal(sites.round_bits(x, "half"), sites.round_bits(x, "sym"))
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(sites.round_bits(exact, "sym"), exact)
    odd = (exact.view(torch.int32) >> 16) & 1 == 1
    moved = sites.round_bits(exact, "half") != exact
    assert torch.equal(moved, odd)

PROBE = """import sys, torch
sys.path[:0] = [{root!r}, {exp!r}]
import rounding, sites
rounding.load({library!r})
torch._C._cpu._init_amx()
for op in (rounding.rotary, rounding.attention):
    out, ref = op(torch.bfloat16, torch.Generator().manual_seed(0))
    same = (sites.round_to_bf16(ref, "trunc") == out).float().mean().item()
    print(op.__name__, same, (sites.round_to_bf16(ref, "rne") == out).float().mean().item())
"""


def test_trunc_equals_vllms_truncating_kernels_bit_for_bit():
    """The op probe's rotary and attention (rounding.py) on the truncating library this chip can
    run, in a process of its own (one library a process): trunc equals every output element;
    rne about half of them."""
    isa = machine()["cpu_isa"]
    library = "_C_AVX512" if "avx512f" in isa else "_C_AVX2"
    script = PROBE.format(root=ROOT, exp=os.path.join(ROOT, "experiments"), library=library)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = dict((line.split()[0], [float(v) for v in line.split()[1:]])
                for line in out.stdout.splitlines() if line.startswith(("rotary", "attention")))
    assert set(rows) == {"rotary", "attention"}
    for op, (trunc, rne) in rows.items():
        assert trunc == 1.0 and rne < 0.7, (op, trunc, rne)


def forward_and_grads(cfg, dtype, strict=True):
    torch.manual_seed(0)
    gpt = model.GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    if strict:
        logits = precision.get_precision(dtype, device="cpu").logits_fn(gpt)(idx)
    else:  # the warm start's mixed precision
        with precision.autocast(dtype, "cpu"):
            logits = gpt(idx)
    logits.float().square().mean().backward()
    return logits.float(), [p.grad.clone() for p in gpt.parameters()]


@pytest.fixture
def restore(monkeypatch):
    """sites.install patches three names for the process: put them back after the test."""
    monkeypatch.setattr(precision, "TensorCoreMatmuls", precision.TensorCoreMatmuls)
    monkeypatch.setattr(model, "apply_rope", model.apply_rope)
    monkeypatch.setattr(model.GPT, "forward", model.GPT.forward)
    monkeypatch.setattr(sites.SiteRounding, "mode", "rne")


def test_rne_leaves_the_trainer_bit_identical_and_trunc_moves_only_the_16_bit_trainer(restore):
    cfg = model.GPTConfig(n_layer=2, n_head=4, n_embd=128, n_hidden=384, max_seq_len=32)
    plain = {k: forward_and_grads(cfg, *k) for k in (("bf16",), ("fp32",), ("bf16", False))}
    sites.install("rne")
    logits, grads = forward_and_grads(cfg, "bf16")
    assert torch.equal(logits, plain[("bf16",)][0])
    assert all(torch.equal(a, b) for a, b in zip(grads, plain[("bf16",)][1]))
    sites.install("trunc")
    assert not torch.equal(forward_and_grads(cfg, "bf16")[0], plain[("bf16",)][0])
    for key in (("fp32",), ("bf16", False)):  # float32, and the warm start: untouched
        assert torch.equal(forward_and_grads(cfg, *key)[0], plain[key][0]), key
    assert sites.ACTIVE == []  # nothing left active outside the trainer's forward
    q = torch.randn(2, 4, 16, 32).to(torch.bfloat16)
    cos, sin = model.rope_cos_sin(cfg, 16, "cpu")
    exact = q.float() * cos + torch.cat([-q.float()[..., 16:], q.float()[..., :16]], -1) * sin
    with precision.TensorCoreMatmuls(torch.bfloat16, strict=True):  # the trainer: the site
        assert torch.equal(model.apply_rope(q, cos, sin), sites.round_to_bf16(exact, "trunc"))
    assert torch.equal(model.apply_rope(q, cos, sin), exact.to(torch.bfloat16))  # elsewhere


def test_nudge_at_the_matmuls_moves_their_outputs_and_leaves_the_two_sites_at_rne(restore):
    """nudge-matmuls: a linear's output rounded by nudge's rule (a quarter of the values off
    rne's), the rotary's and the attention's outputs as the plain trainer rounds them; the trainer
    moves, its float32 and warm-start forwards do not, and the gradient is finite."""
    cfg = model.GPTConfig(n_layer=2, n_head=4, n_embd=128, n_hidden=384, max_seq_len=32)
    plain = {k: forward_and_grads(cfg, *k) for k in (("bf16",), ("fp32",), ("bf16", False))}
    sites.install("nudge-matmuls")
    logits, grads = forward_and_grads(cfg, "bf16")
    assert not torch.equal(logits, plain[("bf16",)][0])
    assert all(g.isfinite().all() for g in grads)
    for key in (("fp32",), ("bf16", False)):
        assert torch.equal(forward_and_grads(cfg, *key)[0], plain[key][0]), key
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(n, 256, generator=g).to(torch.bfloat16) for n in (512, 384))
    q, k, v = (torch.randn(2, 4, 16, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    cos, sin = model.rope_cos_sin(cfg, 16, "cpu")
    exact = torch.nn.functional.linear(x.float(), w.float())
    attention = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True)
    with precision.TensorCoreMatmuls(torch.bfloat16, strict=True):
        out = torch.nn.functional.linear(x, w)
        rope = model.apply_rope(q, cos, sin)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, sites.round_to_bf16(exact, "nudge"))
    moved = (out != exact.to(torch.bfloat16)).float().mean().item()
    assert moved == pytest.approx(1 / 4, abs=0.01)
    assert torch.equal(rope, sites.ORIGINAL["rope"](q, cos, sin))
    assert torch.equal(att, attention.to(torch.bfloat16))

def linear_inputs_and_logits(cfg, mode):
    """The 16-bit trainer's logits and the input of every linear (q, k, v, o, gate, up, down a
    block, then the head), in mode (None: the trainer as it is)."""
    sites.use(mode)
    torch.manual_seed(0)
    gpt = model.GPT(cfg)
    seen = []
    for m in gpt.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda m, i, o: seen.append(i[0].detach().clone()))
    idx = torch.randint(0, cfg.vocab_size, (4, 16))
    with torch.no_grad():
        logits = precision.get_precision("bf16", device="cpu").logits_fn(gpt)(idx)
    sites.use(None)
    return seen, logits


def test_a_rule_at_the_head_moves_the_logits_alone(restore):
    """nudge-head and sym-head: every linear's input, the head's included, bit-identical to the
    plain trainer's; the logits are the plain head's float32 product rounded by the rule (nudge:
    a quarter of them off rne's, sym: half), so nothing before the head moved. nudge-blocks: the
    first linear's input as plain, the head's moved, the logits its product rounded to nearest."""
    cfg = model.GPTConfig(n_layer=2, n_head=4, n_embd=128, n_hidden=384, max_seq_len=32)
    inputs, logits = linear_inputs_and_logits(cfg, None)
    assert len(inputs) == 7 * cfg.n_layer + 1
    torch.manual_seed(0)
    head = model.GPT(cfg).lm_head.weight.to(torch.bfloat16).float()
    exact = torch.nn.functional.linear(inputs[-1].float(), head)  # the head's input is a bf16
    assert torch.equal(logits, exact.to(torch.bfloat16))
    for mode, rule, share in (("nudge-head", "nudge", 1 / 4), ("sym-head", "sym", 1 / 2)):
        moved_inputs, moved = linear_inputs_and_logits(cfg, mode)
        assert all(torch.equal(a, b) for a, b in zip(inputs, moved_inputs)), mode
        assert torch.equal(moved, sites.round_to_bf16(exact, rule)), mode
        assert (moved != logits).float().mean().item() == pytest.approx(share, abs=0.02), mode
    moved_inputs, moved = linear_inputs_and_logits(cfg, "nudge-blocks")  # all but the head
    assert torch.equal(moved_inputs[0], inputs[0]) and not torch.equal(moved_inputs[-1], inputs[-1])
    product = torch.nn.functional.linear(moved_inputs[-1].float(), head)
    assert torch.equal(moved, product.to(torch.bfloat16))  # the head rounds to nearest
    assert sites.HEADS == [] and model.GPT.forward is sites.ORIGINAL["forward"]


def test_the_backward_is_a_casts():
    x = torch.tensor([X, -X, 3.0], requires_grad=True)
    for mode in sites.RULES:  # each rule RoundAt takes
        x.grad = None
        (sites.RoundAt.apply(x, mode).float() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        assert x.grad.tolist() == [1.0, 2.0, 3.0] and x.grad.dtype == torch.float32, mode
    for mode in sites.AT_MATMULS:  # a place, not a rule: refused, not read as another rule
        with pytest.raises(ValueError, match="no rule"):
            sites.round_bits(x.detach(), mode)


def test_layers_reads_every_mode_block_by_block_and_leaves_the_trainer_as_it_was(random_ckpt, restore):
    """sites.layers: each mode's error against float32 after every block, the norm and the logits;
    rne's is the plain bf16 trainer's (offline.layer_errors), truncation's the larger at the first
    block, rne5's (twice the op error) larger than rne6's; the trainer's names restored after.
    With engine, against the engine's kernels (the library this process loaded): at the first
    block the mode that rounds as that library does is the nearer (rne where it rounds, trunc where
    it truncates), and the answer tokens' mismatch is read for every mode."""
    import rounding
    from offline import layer_errors
    out = sites.layers(random_ckpt, engine=True, modes=sites.MODES)
    errors, d = out["fp32"], out["engine"]
    gpt = model.load_hf(random_ckpt, "cpu")
    assert list(errors) == list(sites.MODES) and all(len(e) == gpt.cfg.n_layer + 2 for e in errors.values())
    assert errors["rne"] == layer_errors(gpt, ["bf16"], *sites.teacher_forced(0), "cpu")["bf16"]
    assert errors["trunc"][0] > errors["rne"][0] and errors["rne5"][0] > errors["rne6"][0]
    library = rounding.load(None)  # the one loaded: the process keeps its first
    nearer, farther = ("rne", "trunc") if library == "_C" else ("trunc", "rne")
    assert d[nearer][0] < d[farther][0], (library, d[nearer][0], d[farther][0])
    assert list(out["tokens"]) == list(sites.MODES)
    assert all(0 < t["mean_abs"] and 0 < t["top_share"] <= 1 for t in out["tokens"].values())
    assert precision.TensorCoreMatmuls is sites.ORIGINAL["trainer"] and model.apply_rope is sites.ORIGINAL["rope"]


def test_layers_default_modes_are_the_committed_readings_and_modes_needs_rne_and_trunc():
    """--layers' default modes write the keys of every committed layers reading (so its command
    rewrites it); --modes without trunc is refused in one line, exit 2, before any work."""
    import glob
    import json
    for path in glob.glob(os.path.join(ROOT, "results", "*", "*", "layers*.json")):
        with open(path) as f:
            assert tuple(json.load(f)["layers"]) == sites.LAYER_MODES, path
    refused = [sys.executable, "experiments/sites.py", "--layers", "--modes", "rne", "sym"]
    out = subprocess.run(refused, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
