"""
warm_start.py: the supervised warm start RL begins from (train_grpo.py calls warm_start),
trained once and cached. The GPT for the task (model_config), trained on worked solutions
with a few wrong digits: like a base model, it solves most problems at temperature 1 but not
all: RL's gap to close. It teaches: every dtype's RL run starts from the same float32
weights, trained as base models are (bf16 matmuls, no loss scaling), a wider GPT with a
smaller step. Left out: a pretraining corpus.
"""
import hashlib
import json
import math
import os
import random

import torch

import task
from model import GPT, GPTConfig, pack, save_hf, token_logprobs
from precision import autocast

WARMSTART_DIR = "runs/warmstart"  # checkpoints, keyed by a hash of all that sets them
SFT_STEPS = 600
SFT_LR = 3e-3  # at width SFT_WIDTH; lr x width is held (warm_start)
SFT_WIDTH = 128
SFT_BATCH = 64
SFT_NOISE = 0.005  # the chance that a solution digit is wrong

def model_config(n_items, max_new_tokens, n_layer=4, n_head=4, n_embd=128):
    """The GPT for the task: context a power of two >= the longest prompt + response."""
    prompt, answer = task.make_problem(random.Random(0), n_items)
    prompt, answer = task.prompt_ids(prompt), task.answer_ids(answer)
    if max_new_tokens < len(answer):  # every reward would be 0: nothing to learn
        raise ValueError(f"--max-new-tokens {max_new_tokens}: answers take {len(answer)} tokens")
    max_seq_len = max(128, 2 ** math.ceil(math.log2(len(prompt) + max_new_tokens)))
    return GPTConfig(vocab_size=task.VOCAB_SIZE, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd, n_hidden=3 * n_embd, max_seq_len=max_seq_len,
                     bos_id=task.BOS_ID, eos_id=task.EOS_ID)

def warm_start(cfg, n_items, seed, device):
    """The warm start's checkpoint folder: trained unless cached."""
    lr = SFT_LR * SFT_WIDTH / cfg.n_embd  # Adam moves each weight ~lr: a wider layer sums more
    key = json.dumps({"cfg": cfg.__dict__, "n_items": n_items, "seed": seed,
                      "steps": SFT_STEPS, "lr": lr, "batch": SFT_BATCH,
                      "noise": SFT_NOISE}, sort_keys=True)
    ckpt = os.path.join(WARMSTART_DIR, hashlib.sha256(key.encode()).hexdigest()[:12])
    if os.path.isfile(os.path.join(ckpt, "config.json")):  # save_hf writes it last
        print(f"warm start: reusing {ckpt}")
        return ckpt
    _, train_batch = task.make_splits(seed, n_items, task.N_EVAL)
    torch.manual_seed(task.seed_of("init", seed))
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(SFT_STEPS):
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.5 + 0.5 * math.cos(math.pi * step / SFT_STEPS))
        batch = train_batch(("sft", step), SFT_BATCH)
        noise = random.Random(task.seed_of("noise", seed, step))
        answers = [task.noisy_answer(a, noise, SFT_NOISE) for _, a in batch]
        idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch],
                            [task.answer_ids(a) for a in answers], device)
        # As base models are trained: float32 weights, bf16 matmuls, no loss scaling.
        with autocast("bf16", device):
            loss = -(token_logprobs(model, idx) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == SFT_STEPS - 1:
            print(f"warm start {step:4d}/{SFT_STEPS} | loss {loss.item():.4f}", flush=True)
    save_hf(model, ckpt)
    return ckpt
