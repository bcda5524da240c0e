"""Tokenizer, problems and reward."""
import random

import task


def test_tokenizer_round_trips_any_string():
    rng = random.Random(0)
    samples = ["", "sort 1,2,3=", "héllo wörld ✓ 日本語 🙂", "<|bos|>x<|eos|>",
               "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(300))]
    for s in samples:
        assert task.decode(task.encode(s)) == s
    assert task.encode(task.BOS + task.EOS) == [task.BOS_ID, task.EOS_ID]
    assert task.VOCAB_SIZE == 258


def test_reward_on_correct_wrong_malformed_truncated_empty():
    answer = "1,2,3"  # the answer to "sort 3,1,2="
    good = task.answer_ids(answer)
    assert task.reward(good, answer) == 1.0
    assert task.reward(task.answer_ids("1,3,2"), answer) == 0.0          # wrong
    assert task.reward(task.answer_ids("1,,2,3x"), answer) == 0.0        # malformed
    assert task.reward(good[:-1], answer) == 0.0                         # truncated: no <|eos|>
    assert task.reward(task.encode(answer)[:3], answer) == 0.0           # cut mid-answer
    assert task.reward([], answer) == 0.0                                # empty
    assert task.reward([task.EOS_ID], answer) == 0.0                     # only the end token
    assert task.reward([0xff, 0xfe, task.BOS_ID, task.EOS_ID], answer) == 0.0  # invalid UTF-8, specials


def test_each_answer_is_its_prompts_digits_sorted_and_n_items_sets_the_length():
    _, train_batch = task.make_splits(seed=0, n_items=12, n_eval=10)
    for p, a in train_batch(("a",), 50):
        digits = p[len("sort "):-1].split(",")
        assert len(digits) == 12 and a.split(",") == sorted(digits)
    longer, _ = task.make_splits(0, 20, 10)
    assert len(task.answer_ids(longer[0][1])) == 2 * 20  # 20 digits, 19 commas, <|eos|>


def test_splits_are_disjoint_and_a_function_of_seed_and_key():
    eval_problems, train_batch = task.make_splits(seed=0, n_items=12, n_eval=200)
    assert len({p for p, _ in eval_problems}) == 200
    train = train_batch(("a",), 2000)
    assert not {p for p, _ in train} & {p for p, _ in eval_problems}
    assert train_batch(("a",), 2000) == train and train_batch(("b",), 50) != train[:50]
    assert task.make_splits(0, 12, 200)[0] == eval_problems != task.make_splits(1, 12, 200)[0]


def test_seeds_of_distinct_streams_differ():
    """The old stream_seed, seed * 1,000,003 + stream * 999,983 + step, gave (1, 0, 19) and
    (0, 1, 39) the same seed; every distinct (seed, stream, step) here gets its own."""
    names = [(name, seed, step) for name in ("rollout", "eval", "minibatch", "audit")
             for seed in range(-2, 8) for step in range(-1, 60)]
    seeds = [task.seed_of(*n) for n in names]
    assert len(set(seeds)) == len(names) and all(0 <= s < 2 ** 63 for s in seeds)
    assert task.seed_of("rollout", 1, 19) != task.seed_of("rollout", 0, 39)

