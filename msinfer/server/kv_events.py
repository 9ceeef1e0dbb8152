"""KV-cache events as vLLM publishes them, for routers that score prefix hits precisely
(vllm-router's kv_aware and precise prefix policies, llm-d's KV-cache indexer).

Behind `--kv-events-config` (vLLM's KVEventsConfig as JSON, e.g.
`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}`), each
replica's leader publishes on a ZMQ PUB socket (the endpoint's port plus its data-parallel rank,
as vLLM offsets it) multipart messages (topic, 8-byte big-endian sequence number, msgpack
payload). The payload is vLLM's `KVEventBatch` as msgspec encodes it, the batch positional
and each event a map tagged by `type` (vllm/distributed/kv_events.py; vllm-router's
src/kv_index/wire.rs decodes exactly this): `[ts, [event, ...], data_parallel_rank]`, each
event one of `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes",
"medium"}`, `{"type": "AllBlocksCleared"}`.

A block's hash is the first 8 bytes (big-endian) of the name engine/block_manager.py gives it:
a hash chained over the block's tokens and every token before it, the same on every replica
of the same model and block size (no PYTHONHASHSEED to align).
"""
import json
import queue
import threading
import time

from ..errors import MsinferError

MEDIUM = "GPU"  # vLLM's name for the device's KV cache
DEFAULTS = {"enable_kv_cache_events": False, "publisher": None, "endpoint": "tcp://*:5557",
            "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000,
            "max_queue_size": 100_000, "topic": ""}


def parse_config(text):
    """vLLM's KVEventsConfig from `--kv-events-config` JSON; None when events are off."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise MsinferError(f"--kv-events-config: not JSON: {e}") from None
    if not isinstance(given, dict):
        raise MsinferError("--kv-events-config: must be a JSON object")
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise MsinferError(f"--kv-events-config: unknown field {unknown[0]!r} (known: "
                           f"{', '.join(DEFAULTS)})")
    config = {**DEFAULTS, **given}
    if config["publisher"] is None:  # vLLM's default: zmq when events are enabled
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if config["publisher"] not in ("zmq", "null"):
        raise MsinferError(f"--kv-events-config: publisher {config['publisher']!r}: msinfer "
                           f"publishes with 'zmq' (or 'null': none)")
    if config["replay_endpoint"] is not None:
        raise MsinferError("--kv-events-config: replay_endpoint: msinfer keeps no replay "
                           "buffer; subscribers resynchronise on AllBlocksCleared")
    if not config["enable_kv_cache_events"] or config["publisher"] == "null":
        return None
    return config


def offset_endpoint(endpoint, rank):
    """`endpoint` for data-parallel rank `rank`: its TCP port plus the rank (vLLM's rule)."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def block_hash(name):
    return int.from_bytes(name[:8], "big")


class KVEventPublisher:
    """The listener of a BlockManager (block_manager.listener): its calls, on the engine's
    thread, queue events; a thread of its own batches what is queued and publishes it."""

    def __init__(self, config, block_size, rank=0):
        import zmq  # only a server that publishes needs pyzmq

        self.block_size, self.rank = block_size, rank
        self.endpoint = offset_endpoint(config["endpoint"], rank)
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config["hwm"])
        if "*" in self.endpoint or "::" in self.endpoint or not self.endpoint.startswith("tcp"):
            self._socket.bind(self.endpoint)  # as vLLM: a wildcard binds, a host connects
        else:
            self._socket.connect(self.endpoint)
        self._topic = config["topic"].encode()
        self._queue = queue.Queue(maxsize=config["max_queue_size"])
        self._seq = 0
        threading.Thread(target=self._publish, daemon=True, name="msinfer-kv-events").start()

    # -- the block manager's listener (engine thread) ------------------------------------------
    def stored(self, names, parent, token_ids):
        self._queue.put({"type": "BlockStored", "block_hashes": [block_hash(n) for n in names],
                         "parent_block_hash": None if parent is None else block_hash(parent),
                         "token_ids": list(token_ids), "block_size": self.block_size,
                         "lora_id": None, "medium": MEDIUM, "lora_name": None})

    def removed(self, names):
        self._queue.put({"type": "BlockRemoved", "block_hashes": [block_hash(n) for n in names],
                         "medium": MEDIUM})

    def cleared(self):
        self._queue.put({"type": "AllBlocksCleared"})

    # -- its thread ------------------------------------------------------------------------------
    def _publish(self):
        import msgpack

        while True:
            events = [self._queue.get()]
            while not self._queue.empty() and len(events) < 1024:
                events.append(self._queue.get_nowait())
            payload = msgpack.packb([time.time(), events, self.rank])
            self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
            self._seq += 1


def publish(engine, config, rank=0):
    """Publish `engine`'s prefix-cache events per `config` (parse_config's); the endpoint."""
    publisher = KVEventPublisher(config, engine.config.limits.block_size, rank)
    engine.listen_to_prefix_cache(publisher)
    return publisher.endpoint
