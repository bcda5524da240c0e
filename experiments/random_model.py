"""
experiments/random_model.py: a small Qwen2 with random weights and a byte-level tokenizer
trained here, saved as a Hugging Face folder: a model of another architecture than this
project's Llama, that vLLM serves and transformers loads, made without the network (the
meter's test and its page run the meter on it).

    python experiments/random_model.py DIR

Its sizes: 2 layers, width 128, 4 heads of 32 (a head size vLLM's CPU attention serves), 2
key-value heads (grouped queries, as Qwen2 ships), biases on q, k and v (Qwen2's). Left out:
training it: the mismatch needs no skill, only weights and tokens.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
from meter import PROMPTS  # noqa: E402  (the text the tokenizer learns its merges from)

VOCAB = 384  # the tokenizer's 256 bytes, its merges and the end token, rounded up
END = "<|endoftext|>"

def tokenizer(folder):
    """A byte-level BPE learnt from the meter's prompts: any text encodes."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(PROMPTS * 4, vocab_size=VOCAB - 8, special_tokens=[END])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END, bos_token=END)
    tok.save_pretrained(folder)
    return tok

def make(folder, seed=0):
    """The model and its tokenizer in `folder`; returns the folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    end = tokenizer(folder).convert_tokens_to_ids(END)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=end, eos_token_id=end)
    torch.manual_seed(seed)
    # Weights of std 0.02 (transformers' init) give a near-uniform next token; twice that
    # makes the policy less flat, so the buckets of pi are not all one.
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # the matrices; the norms' weights stay 1
                p.mul_(2.0)
    model.save_pretrained(folder)
    return folder

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python experiments/random_model.py DIR", file=sys.stderr)
        sys.exit(2)
    os.makedirs(sys.argv[1], exist_ok=True)
    print(make(sys.argv[1]))
