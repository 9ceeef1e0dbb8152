"""A pytest-xdist scheduler that hands out units of tests (conftest.py says which), written
against the protocol of xdist's public `pytest_xdist_make_scheduler` hook (xdist's
scheduler/protocol.py), with nothing of xdist's own schedulers.

- A unit's tests go to one worker together, in collection order: its module fixtures are made
  once.
- Units are given out in the order asked for, then in collection order.
- A worker gets its next unit when it has one test left: xdist's worker holds its last test
  until it knows the next one (or is told to stop), so that it can tear fixtures down.
- A worker that crashes: its test in progress is reported as the crash, the tests it had left
  go back to the front of the queue, for the worker xdist starts in its place.
- With three workers or more, the last (waiting_worker) takes the units that mostly wait,
  then units that start no job (conftest.py runs those at the lowest priority); the others
  take waiting units only when nothing else is left.
"""


def waiting_worker(numnodes):
    """The id of the worker that takes the waiting units first: the last of three or more."""
    return f"gw{numnodes - 1}" if numnodes >= 3 else None


class UnitScheduling:
    def __init__(self, config, read_units):
        """read_units() -> ({test id: its unit's name}, [the units given out before the
        others, in this order], [the units that mostly wait]); read when the workers have
        collected."""
        self.config, self.read_units = config, read_units
        self.unit_of = {}
        # -n N is --tx popen N times; a --tx spec of its own may say "N*popen"
        self.numnodes = sum(int(spec.split("*")[0]) if "*" in spec else 1
                            for spec in config.getoption("tx"))
        self.collections = {}  # worker -> the test ids it collected
        self.pending = {}  # worker -> the ids it was sent and has not finished, in order
        self.queue = {}  # unit -> its test ids, in the order units are given out
        self.first = set()  # the units given out first (the jobs of several ranks)
        self.waiting = set()  # the units that mostly wait
        self.scheduled = False

    # ---- the state xdist's session asks about ----

    @property
    def nodes(self):
        return list(self.pending)

    @property
    def collection_is_completed(self):
        return len(self.collections) >= self.numnodes

    @property
    def tests_finished(self):
        # a worker's last test runs once it is told to stop (when this says True)
        return (self.collection_is_completed and not self.queue
                and all(len(tests) < 2 for tests in self.pending.values()))

    @property
    def has_pending(self):
        return bool(self.queue) or any(self.pending.values())

    # ---- workers come and go ----

    def add_node(self, node):
        self.pending[node] = []

    def add_node_collection(self, node, collection):
        self.collections[node] = list(collection)

    def remove_node(self, node):
        """The test it was running if it had tests left (a crash), else None."""
        left = self.pending.pop(node)
        if not left:
            return None
        crashed, rest = left[0], left[1:]
        requeued = {}
        for nodeid in rest:
            requeued.setdefault(self.unit_of[nodeid], []).append(nodeid)
        self.queue = {**requeued, **self.queue}
        for other in self.nodes:
            self._give(other)
        return crashed

    # ---- tests ----

    def schedule(self):
        """Called once every worker has collected (and again when a replacement joins)."""
        if not self.scheduled:
            self.scheduled = True
            collection = self._common_collection()
            if collection is None:
                return
            self.unit_of, first, waiting = self.read_units()
            self.first, self.waiting = set(first), set(waiting)
            units = {}
            for nodeid in collection:
                units.setdefault(self.unit_of[nodeid], []).append(nodeid)
            order = [u for u in first if u in units] + list(units)
            self.queue = {unit: units[unit] for unit in dict.fromkeys(order)}
        for node in self.nodes:
            self._give(node)

    def mark_test_complete(self, node, item_index, duration=0):
        self.pending[node].remove(self.collections[node][item_index])
        self._give(node)

    def mark_test_pending(self, item):
        raise NotImplementedError("units are never stolen back")

    def remove_pending_tests_from_node(self, node, indices):
        raise NotImplementedError("units are never stolen back")

    def _give(self, node):
        """Units for `node` until it has two tests or more to run; told to stop once none
        are left."""
        if node.shutting_down or node not in self.collections:
            return
        while len(self.pending[node]) < 2 and (unit := self._next_unit(node)) is not None:
            tests = self.queue.pop(unit)
            self.pending[node] += tests
            index = {nodeid: i for i, nodeid in enumerate(self.collections[node])}
            node.send_runtest_some([index[nodeid] for nodeid in tests])
        if self._next_unit(node) is None:
            node.shutdown()

    def _next_unit(self, node):
        """The first unit in the queue that `node` takes, or None: the waiting worker takes
        a waiting unit, else one that starts no job (not one of the first units); the
        others any but a waiting unit, else a waiting one."""
        if node.gateway.id == waiting_worker(self.numnodes):
            choices = (lambda u: u in self.waiting, lambda u: u not in self.first)
        else:
            choices = (lambda u: u not in self.waiting, lambda u: True)
        for fits in choices:
            unit = next((u for u in self.queue if fits(u)), None)
            if unit is not None:
                return unit
        return None

    def _common_collection(self):
        """The workers' collection, or None (a failed collection report) if two differ."""
        (first, ids), *others = self.collections.items()
        for node, other in others:
            if other != ids:
                import pytest

                differ = sorted(set(ids) ^ set(other))[:5] or ["(the same tests, reordered)"]
                self.config.hook.pytest_collectreport(report=pytest.CollectReport(
                    nodeid=node.gateway.id, outcome="failed", result=[],
                    longrepr=f"workers {first.gateway.id} and {node.gateway.id} collected "
                             f"different tests: {', '.join(differ)}"))
                return None
        return ids
