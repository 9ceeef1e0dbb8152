"""`msinfer serve`'s own settings: `ServerConfig`, built once from the CLI's arguments.

What the engine is (its limits, prefix caching, the checkpoint) is not here: the server reads
it from the served LLM's EngineConfig (msinfer/engine_config.py), passed beside this one.
"""
import dataclasses

# What one request body may hold before it is read at all (413): a 32K-token prompt as token
# ids is about 200 KB of JSON; chat histories as text are smaller.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_names: list  # names clients use; the first is reported back in responses
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = None  # None: /v1 is open
    max_queue: int = 1024  # waiting requests beyond which new ones get 503 + Retry-After
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get 413
    stall_timeout: float = 60.0  # a step or a silence longer than this ends the job
    reasoning_parser: str = None  # "qwen3": chat answers' <think> part as reasoning_content
    lazy_warmup: bool = False  # ready at once, graphs compiled on first use (development)
    kv_events: dict = None  # vLLM's KVEventsConfig: publish KV-cache events (kv_events.py)

    @classmethod
    def from_args(cls, args):
        """From `msinfer serve`'s parsed arguments (cli/serve.py)."""
        return cls(model_names=args.served_model_name or [args.model], host=args.host,
                   port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                   shutdown_timeout=args.shutdown_timeout,
                   max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                   stall_timeout=args.stall_timeout, reasoning_parser=args.reasoning_parser,
                   lazy_warmup=args.lazy_warmup, kv_events=args.kv_events_config)

    def kv_event_endpoints(self, replicas):
        """Where each data-parallel rank publishes its KV-cache events; () without them."""
        if not self.kv_events:
            return ()
        from .kv_events import offset_endpoint
        return tuple(offset_endpoint(self.kv_events["endpoint"], r) for r in range(replicas))
