"""KV-cache events (server/kv_events.py) from the block manager, decoded as vLLM's wire format
is decoded (msgpack: a positional batch of maps tagged by `type`), without a model: stored blocks chain to
their parents and carry their tokens, eviction says BlockRemoved, a reset AllBlocksCleared.
The same over a running server, against its prefix-cache counters: test_fleet_server.py."""
import msgpack
import pytest
import zmq

from msinfer.engine.block_manager import BlockManager, block_names
from msinfer.engine.sampling import SamplingParams
from msinfer.engine.sequence import Sequence
from msinfer.errors import MsinferError
from msinfer.parallel.distributed import free_port
from msinfer.planning.kv_layout import CacheLayout
from msinfer.server.kv_events import KVEventPublisher, block_hash, parse_config

BLOCK = 4


def _run(blocks, name, tokens):
    """A sequence admitted, computed in full and released, as a finished request's."""
    seq = Sequence(name, list(tokens), SamplingParams(max_tokens=1))
    blocks.admit(seq, blocks.match(seq))
    seq.computed = seq.length
    blocks.computed(seq)
    blocks.release(seq)
    return seq


def _receive(socket, count):
    batches = []
    while sum(len(b[1]) for b in batches) < count:
        assert socket.poll(5000), "no KV event within 5 s"
        topic, seq, payload = socket.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        batches.append(msgpack.unpackb(payload))
    return [event for batch in batches for event in batch[1]], batches


def test_block_events_in_vllms_wire_format():
    port = free_port()
    config = parse_config(f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                          f'"endpoint": "tcp://*:{port}", "topic": "kv"}}')
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=BLOCK,
                         num_blocks=5, dtype_bytes=1)  # 4 usable blocks
    blocks = BlockManager(layout)
    blocks.listener = KVEventPublisher(config, BLOCK)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    # the slow joiner: publish resets until the subscriber hears one
    while True:
        blocks.reset_prefix_cache()
        if sub.poll(200):
            sub.recv_multipart()
            break
    first = list(range(1, 10))  # 9 tokens: blocks [1..4], [5..8] computed, one partial
    _run(blocks, "a", first)
    events, batches = _receive(sub, 1)
    assert batches[0][0] > 0 and batches[0][2] == 0  # [ts, events, data_parallel_rank]
    names = block_names(first, BLOCK, 2)
    assert events == [{"type": "BlockStored", "block_hashes": [block_hash(n) for n in names],
                       "parent_block_hash": None, "token_ids": first[:8], "block_size": BLOCK,
                       "lora_id": None, "medium": "GPU", "lora_name": None}]
    # another prompt over the first block: only its new block is stored, chained to it
    _run(blocks, "b", first[:4] + [50, 51, 52, 53, 54])
    (stored,), _ = _receive(sub, 1)
    assert stored["type"] == "BlockStored"
    assert stored["parent_block_hash"] == block_hash(names[0])
    assert stored["token_ids"] == [50, 51, 52, 53]
    # 4 blocks, 3 named and free: a 3-block prompt evicts the least recently freed
    _run(blocks, "c", [90 + i for i in range(13)])
    events, _ = _receive(sub, 2)
    assert [e["type"] for e in events].count("BlockRemoved") >= 1
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert set(removed) <= {block_hash(n) for n in names} | {stored["block_hashes"][0]}
    assert blocks.reset_prefix_cache()
    assert _receive(sub, 1)[0] == [{"type": "AllBlocksCleared"}]


def test_a_reset_is_refused_while_a_sequence_holds_blocks():
    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=BLOCK,
                         num_blocks=5, dtype_bytes=1)
    blocks = BlockManager(layout)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    blocks.admit(seq, [])
    assert not blocks.reset_prefix_cache()
    blocks.release(seq)
    assert blocks.reset_prefix_cache()


@pytest.mark.parametrize("text, needle", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"endpoints": 1}', "unknown field 'endpoints'"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
])
def test_a_bad_kv_events_config_is_refused_by_name(text, needle):
    with pytest.raises(MsinferError, match=needle):
        parse_config(text)


def test_events_off_unless_enabled_with_a_publisher():
    assert parse_config('{"publisher": "zmq"}') is None
    assert parse_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert parse_config('{"enable_kv_cache_events": true}')["publisher"] == "zmq"  # vLLM's
