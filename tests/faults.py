"""Faults the tests plant in `msinfer serve`'s ranks; msinfer's own code holds none.

`drop_a_request(engine, rank, due)`: follower `rank`'s engine drops the newest request it
holds, of its own accord, before the first step that `due(step)` accepts, as a rank that
decided by itself that the request finished would. Its schedule then differs from its
leader's and the leader's next frame must catch it (lockstep.follow raises RanksDiverged,
naming the rank and the step). Only the engine's public methods are wrapped, so it plants
into LLMEngine and tests/fake_engine.FakeEngine alike.

In a launched job the ranks are processes of their own: `PLANT_DIVERGENCE` (the variable)
= "RANK:STEP" or "RANK:PATH" (the first step after the file PATH exists), with
`FAULT_SITE` on PYTHONPATH. Python imports fault_site/sitecustomize.py at every start,
which wraps lockstep.follow so that follower RANK's engine drops a request
(`plant_from_environment`). tests/server/test_serve.py does so; nothing else reads it.
"""
import os

PLANT_DIVERGENCE = "MSINFER_PLANT_DIVERGENCE"
FAULT_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_site")


def drop_a_request(engine, rank, due):
    """Wrap `engine` (a follower's) so that it drops a request before the first step for
    which due(step) is true (and holds a request), once."""
    live = {}  # the request ids it holds, oldest first
    add, abort, apply, begin = (engine.add_request, engine.abort_request,
                                engine.apply_decisions, engine.begin_step)
    planted = []

    def add_request(request_id, *args, **kwargs):
        add(request_id, *args, **kwargs)
        live[request_id] = True

    def abort_request(request_id):
        abort(request_id)
        live.pop(request_id, None)

    def apply_decisions(decisions):
        apply(decisions)
        for request_id, _, reason in decisions:
            if reason:
                live.pop(request_id, None)

    def begin_step():
        step = engine.step_count + 1
        if not planted and live and due(step):
            request_id = next(reversed(live))
            print(f"{PLANT_DIVERGENCE}: rank {rank} drops request {request_id!r} before step "
                  f"{step} (planted divergence)", flush=True)
            abort_request(request_id)
            planted.append(request_id)
        return begin()
    engine.add_request, engine.abort_request = add_request, abort_request
    engine.apply_decisions, engine.begin_step = apply_decisions, begin_step


def plant_from_environment():
    """Under PLANT_DIVERGENCE="RANK:STEP" or "RANK:PATH": wrap lockstep.follow so that
    follower RANK's engine drops a request (drop_a_request) at that step."""
    value = os.environ.get(PLANT_DIVERGENCE, "")
    target, _, when = value.partition(":")
    if not target.isdigit() or not when:
        return
    from msinfer.server import lockstep

    def due(step):
        return step >= int(when) if when.isdigit() else os.path.exists(when)
    follow = lockstep.follow

    def follow_planted(engine, channel, rank, watch=None):
        if rank == int(target):
            drop_a_request(engine, rank, due)
        return follow(engine, channel, rank, watch)
    lockstep.follow = follow_planted
