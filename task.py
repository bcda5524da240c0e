"""
task.py: the tokenizer, the sanity task and its reward. Change this file to try another task.

Tokenizer: a tiktoken Encoding built in code, no download: one token per byte (256 ranks, no
merges) plus <|bos|> and <|eos|> (end of answer). Every string round-trips, and one character
= one token keeps responses long enough for rounding error to compound.

Task: sort digits, e.g. "<|bos|>sort 3,9,1,3,0,7,2,8,5,6,4,1=" -> "0,1,1,2,3,3,4,5,6,7,8,9<|eos|>".
A small transformer learns it every time, so a healthy RL run heads to 100 % reward and a sick
one shows; every answer token is forced by the prompt, so the reward is exact, and the length
(2 x n_items tokens) is the difficulty knob.
"""
import hashlib
import json
import random

import tiktoken

BOS, EOS = "<|bos|>", "<|eos|>"

# pat_str splits text before BPE; with no merges any split gives the same bytes.
TOKENIZER = tiktoken.Encoding(name="bytes", pat_str=r".",
                              mergeable_ranks={bytes([i]): i for i in range(256)},
                              special_tokens={BOS: 256, EOS: 257})
BOS_ID, EOS_ID = TOKENIZER.encode_single_token(BOS), TOKENIZER.encode_single_token(EOS)
VOCAB_SIZE = TOKENIZER.n_vocab  # 258

def encode(text):
    return TOKENIZER.encode(text, allowed_special="all")

def decode(ids):
    # errors="replace": a policy can sample bytes that are not UTF-8: reward, don't crash.
    return TOKENIZER.decode_bytes(ids).decode("utf-8", errors="replace") if ids else ""

def seed_of(*parts):
    """The project's one seeding scheme: a 63-bit seed for the stream named by `parts`, e.g.
    seed_of("rollout", 0, 7). A hash of the parts' JSON: distinct names give distinct streams
    (two collide with chance 2^-63), unlike arithmetic such as seed * 1,000,003 + step."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch.manual_seed takes < 2^63

def make_problem(rng, n_items):
    """One problem: (prompt text, answer text), digits drawn with replacement."""
    digits = [rng.randrange(10) for _ in range(n_items)]
    return "sort " + ",".join(map(str, digits)) + "=", ",".join(map(str, sorted(digits)))

def make_splits(seed, n_items, n_eval):
    """Held-out problems (a fixed list) and train_batch(key, n): n training problems drawn from the
    stream named `key` (a tuple naming phase and step, e.g. ("sft", 12) or ("rl", 0, 7)), never an
    eval prompt. Determined by the seed and the key alone: repeatable runs, exact resume."""
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
    """A worked solution with mistakes: each digit replaced by a random one with probability p.
    Trained on these, the model learns the procedure but keeps ~0.9p on a wrong digit at each
    position, like a competent base model not yet sharp: at temperature 1 it is right about
    (1 - 0.9p)^n_items of the time, and RL has that gap to close."""
    noisy = (str(rng.randrange(10)) if c.isdigit() and rng.random() < p else c for c in answer)
    return "".join(noisy)

def prompt_ids(prompt):
    return [BOS_ID] + encode(prompt)

def answer_ids(answer):
    """The worked solution as the model should write it: answer tokens then <|eos|>."""
    return encode(answer) + [EOS_ID]

def reward(response_ids, answer):
    """1.0 for exactly the right answer and <|eos|>; 0.0 for anything else: wrong, malformed,
    truncated (no <|eos|>) or empty. Never raises."""
    if not response_ids or response_ids[-1] != EOS_ID:
        return 0.0
    return 1.0 if decode(list(response_ids[:-1])) == answer else 0.0
