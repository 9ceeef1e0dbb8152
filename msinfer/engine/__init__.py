"""The serving engine: paged KV cache, chunked prefill, continuous batching.

    llm_engine.py     add_request / step / abort_request: schedule -> run -> sample ->
                      postprocess, each a short method
    sequence.py       one request in flight: its tokens, blocks, and stop checks
    scheduler.py      which sequences run each step (pure Python, same on every rank)
    block_manager.py  the KV cache's blocks: free list, prefix cache by block hash
    model_runner.py   a step's tensors, the compiled graphs, logits
    sampling.py       SamplingParams, the Sampler, logprobs
    structured.py     grammars for structured output
    tokenizer.py      tokenizer.json, chat templates, incremental detokenizing
    text.py           a text that grows by pieces, its views, searches in its new part
    compile_cache.py  compiled graphs kept across restarts
"""
from .llm_engine import EngineStats, LLMEngine, RequestOutput

__all__ = ["LLMEngine", "RequestOutput", "EngineStats"]
