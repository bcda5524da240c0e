"""
task.py: the tokenizer, the task and its reward. Change this file to try another task.

Tokenizer: tiktoken, built in code: one token a byte, plus <|bos|> and <|eos|>.
Task: sort digits, "<|bos|>sort 3,9,1,3,0,7,2,8,5,6,4,1=" -> "0,1,1,2,3,3,4,5,6,7,8,9<|eos|>".
A small transformer learns it every time, so a healthy RL run heads to 100 % reward and a
sick one shows; the reward is exact; the length (2 x n_items tokens) is the knob.
Left out: partial credit, chat templates.
"""
import hashlib
import json
import random

import tiktoken

BOS, EOS = "<|bos|>", "<|eos|>"
N_EVAL = 256  # held-out problems

TOKENIZER = tiktoken.Encoding(name="bytes", pat_str=r".",
                              mergeable_ranks={bytes([i]): i for i in range(256)},
                              special_tokens={BOS: 256, EOS: 257})
BOS_ID, EOS_ID = TOKENIZER.encode_single_token(BOS), TOKENIZER.encode_single_token(EOS)
VOCAB_SIZE = TOKENIZER.n_vocab  # 258

def encode(text):
    return TOKENIZER.encode(text, allowed_special="all")

def decode(ids):
    # errors="replace": a policy can sample bytes that are not UTF-8
    return TOKENIZER.decode_bytes(ids).decode("utf-8", errors="replace") if ids else ""

def seed_of(*parts):
    """The one seeding scheme: a 63-bit seed for the stream named by parts (a hash)."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch.manual_seed takes < 2^63

def make_problem(rng, n_items):
    """One problem: (prompt text, answer text), digits drawn with replacement."""
    digits = [rng.randrange(10) for _ in range(n_items)]
    return "sort " + ",".join(map(str, digits)) + "=", ",".join(map(str, sorted(digits)))

def make_splits(seed, n_items, n_eval):
    """Held-out problems, and train_batch(key, n): n others from the stream named key."""
    rng = random.Random(seed_of("eval", seed))
    eval_set = {}
    while len(eval_set) < n_eval:
        prompt, answer = make_problem(rng, n_items)
        eval_set[prompt] = answer

    def train_batch(key, n):
        rng, batch = random.Random(seed_of("train", seed, *key)), []
        while len(batch) < n:
            prompt, answer = make_problem(rng, n_items)
            if prompt not in eval_set:
                batch.append((prompt, answer))
        return batch
    return list(eval_set.items()), train_batch

def noisy_answer(answer, rng, p):
    """A solution, each digit wrong with probability p: a base model not yet sharp."""
    noisy = (str(rng.randrange(10)) if c.isdigit() and rng.random() < p else c for c in answer)
    return "".join(noisy)

def prompt_ids(prompt):
    return [BOS_ID] + encode(prompt)

def answer_ids(answer):
    """The worked solution as the model should write it: answer tokens then <|eos|>."""
    return encode(answer) + [EOS_ID]

def reward(response_ids, answer):
    """1.0 for exactly the answer and <|eos|>; 0.0 for anything else. Never raises."""
    if not response_ids or response_ids[-1] != EOS_ID:
        return 0.0
    return 1.0 if decode(list(response_ids[:-1])) == answer else 0.0
