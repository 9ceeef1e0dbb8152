"""The serving engine: paged KV cache, chunked prefill, continuous batching.

    kv_cache.py    the cache layout and its block manager (all the slot arithmetic)
    sequence.py    one request in flight
    scheduler.py   which sequences run each step (pure Python, same on every rank)
    runner.py      a step's tensors, the compiled graphs, logits
    workspace.py   what one layer of a call holds; how many layers one graph runs
    llm_engine.py  add_request / step / abort_request, sampling and stop checks
"""
from .llm_engine import EngineStats, LLMEngine, RequestOutput

__all__ = ["LLMEngine", "RequestOutput", "EngineStats"]
