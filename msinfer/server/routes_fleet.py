"""The endpoints routers and gateways call besides the OpenAI API, in the shapes they parse.

- `/get_load`: vllm-router's power-of-two policy reads `load` (an integer: requests running
  plus waiting); SGLang's names ride along (`num_reqs`, `num_waiting_reqs`, `num_tokens`).
- `/get_server_info`, `/get_model_info`: what vllm-router's workers report (`model_id`,
  `model_path`, `tokenizer_path`, `kv_block_size` for its KV-event index), with SGLang's sizes.
- `/flush_cache` (SGLang) and `/reset_prefix_cache` (vLLM): forget the prefix cache, refused
  (400) while requests hold blocks, as both refuse it.
- `/health_generate`: 200 once a one-token generation ran through the engine, 503 otherwise.
- `/ping` (SageMaker's probe): /health's answer. `/kv_event_sources`: where the KV-cache
  events are published (server/kv_events.py), per data-parallel rank; 404 without them.
"""
import asyncio
import os
import uuid

from fastapi.responses import JSONResponse, PlainTextResponse

from .. import __version__
from ..engine.sampling import SamplingParams
from ..errors import MsinferError
from .lockstep import ServerBusy

HEALTH_GENERATE_TIMEOUT = 60.0  # seconds a probe generation may take before it fails
_INSTANCE = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def replica_stats(engine_loop):
    """Each replica's EngineStats (a replicas.Router, or one lockstep.EngineLoop)."""
    if hasattr(engine_loop, "replicas"):
        return [s for s in (engine_loop.stats(i) for i in range(engine_loop.replicas)) if s]
    return [engine_loop.stats]


def add_fleet_routes(app, serving, health):
    """Add the routes to `app` (serving: serving.Serving; health: the /health route)."""
    _add_load_and_info(app, serving)
    _add_cache_and_probes(app, serving, health)


def _add_load_and_info(app, serving):
    engine_loop, config, engine = serving.engine_loop, serving.config, serving.engine_config
    block_size = engine.limits.block_size

    @app.get("/get_load")
    async def get_load():
        stats = replica_stats(engine_loop)
        running = sum(s.num_running for s in stats)
        waiting = sum(s.num_waiting for s in stats)
        return {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting,
                "num_tokens": sum(s.num_blocks_used for s in stats) * block_size}

    def model_info():
        root = engine.model
        return {"model_id": config.model_names[0], "model_path": root, "tokenizer_path": root,
                "served_model_names": list(config.model_names), "is_generation": True}

    @app.get("/get_model_info")
    async def get_model_info():
        return model_info()

    @app.get("/get_server_info")
    async def get_server_info():
        stats = replica_stats(engine_loop)
        return {**model_info(), "instance_id": _INSTANCE, "version": __version__,
                "kv_block_size": block_size, "context_length": engine.max_model_len,
                "max_model_len": engine.max_model_len,
                "max_running_requests": engine.limits.max_num_seqs,
                "max_total_num_tokens": stats[0].num_blocks_total * block_size,
                "data_parallel_size": len(stats),
                "kv_events": bool(config.kv_events)}


def _add_cache_and_probes(app, serving, health):
    engine_loop, config = serving.engine_loop, serving.config

    async def reset():
        done = await asyncio.wrap_future(engine_loop.reset_prefix_cache())
        if not done:
            return JSONResponse({"error": {
                "message": "Cache not flushed: requests are running; retry when they are done",
                "type": "invalid_request_error", "param": None, "code": "requests_running"}},
                status_code=400)
        return PlainTextResponse("Cache flushed.")

    # One route per method: FastAPI names a route of two methods' operations alike, which
    # leaves /openapi.json with duplicate operation ids.
    for path, handler, methods in (("/flush_cache", reset, ("GET", "POST")),
                                   ("/reset_prefix_cache", reset, ("POST",)),
                                   ("/ping", health, ("GET", "POST"))):
        for method in methods:
            app.add_api_route(path, handler, methods=[method],
                              operation_id=f"{handler.__name__}_{path[1:]}_{method.lower()}")

    @app.get("/health_generate")
    async def health_generate():
        try:
            await asyncio.wait_for(_generate_one(serving), HEALTH_GENERATE_TIMEOUT)
        except (ServerBusy, MsinferError, asyncio.TimeoutError, RuntimeError) as e:
            return JSONResponse({"status": f"generation failed: {e or type(e).__name__}"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        if not config.kv_events:
            return JSONResponse({"error": {"message": "KV-cache events are off "
                                           "(--kv-events-config)", "type": "not_found",
                                           "param": None, "code": None}}, status_code=404)
        endpoints = config.kv_event_endpoints(getattr(engine_loop, "replicas", 1))
        return {str(rank): {**config.kv_events, "endpoint": endpoint}
                for rank, endpoint in enumerate(endpoints)}


async def _generate_one(serving):
    """One token of a one-token prompt, through the engine loop as any request."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def sink(out):
        def deliver():
            if finished.done():
                return
            if isinstance(out, Exception):
                finished.set_exception(RuntimeError(str(out)))
            elif out.finished:
                finished.set_result(out)
        loop.call_soon_threadsafe(deliver)
    request_id = f"health-generate-{uuid.uuid4().hex}"
    accepted = serving.engine_loop.submit(request_id, [0], SamplingParams(max_tokens=1,
                                                                          temperature=0.0),
                                          None, sink)
    try:
        await asyncio.wrap_future(accepted)
        out = await finished
    finally:
        if not finished.done():
            serving.engine_loop.abort(request_id)
    if out.finish_reason == "error":
        raise RuntimeError(out.error or "the model failed")
