"""warm_start.py: the supervised warm start lowers the loss and is cached per seed; the model's
context is sized for the task."""
import os

import torch

import task
import warm_start
from conftest import tiny_args
from model import GPT, load_hf, pack, token_logprobs


def test_warm_start_lowers_loss(tmp_path):
    args = tiny_args(str(tmp_path))
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    ckpt = warm_start.warm_start(cfg, args.n_items, 0, "cpu")
    batch = task.make_splits(0, args.n_items, 8)[1](("check",), 16)
    idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch], [task.answer_ids(a) for _, a in batch], "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        nll = {name: -(token_logprobs(m, idx) * mask).sum().item() / mask.sum().item() for name, m in
               (("init", GPT(cfg)), ("warm", load_hf(ckpt)))}
    assert nll["warm"] < 0.5 * nll["init"], nll


def test_warm_start_is_cached_per_seed(tmp_path):
    args = tiny_args(str(tmp_path))
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    ckpt = warm_start.warm_start(cfg, args.n_items, 0, "cpu")
    mtime = os.path.getmtime(os.path.join(ckpt, "model.safetensors"))
    assert warm_start.warm_start(cfg, args.n_items, 0, "cpu") == ckpt  # reused, not retrained
    assert os.path.getmtime(os.path.join(ckpt, "model.safetensors")) == mtime
    assert warm_start.warm_start(cfg, args.n_items, 1, "cpu") != ckpt  # the cache key covers the seed
