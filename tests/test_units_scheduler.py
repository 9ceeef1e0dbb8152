"""units_scheduler.UnitScheduling driven as xdist's session drives it, with workers that record
what they are sent: units whole and in order, the first units first, the next unit once a
worker has one test left, a crash's remaining tests to the worker that replaces it, waiting
units to the third worker, unless nothing else is left, and then units that start no job."""
from types import SimpleNamespace

from units_scheduler import UnitScheduling

TESTS = ["a.py::1", "a.py::2", "b.py::1", "c.py::1", "c.py::2", "c.py::3", "d.py::1"]
UNITS = {"a.py::1": "a", "a.py::2": "a", "b.py::1": "b.py::1", "c.py::1": "c", "c.py::2": "c",
         "c.py::3": "c", "d.py::1": "d.py::1"}


class Worker:
    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent += [TESTS[i] for i in indices]

    def shutdown(self):
        self.shutting_down = True


def started(workers, first=(), waiting=()):
    config = SimpleNamespace(getoption=lambda name: [f"{len(workers)}*popen"])
    scheduler = UnitScheduling(config, lambda: (UNITS, list(first), list(waiting)))
    for worker in workers:
        scheduler.add_node(worker)
        assert not scheduler.collection_is_completed
        scheduler.add_node_collection(worker, TESTS)
    assert scheduler.collection_is_completed
    scheduler.schedule()
    return scheduler


def finish(scheduler, worker, test):
    scheduler.mark_test_complete(worker, TESTS.index(test))


def test_units_go_whole_first_ones_first_and_the_next_when_one_test_is_left():
    one, two = Worker("gw0"), Worker("gw1")
    scheduler = started([one, two], first=["c"])
    assert one.sent == ["c.py::1", "c.py::2", "c.py::3"]
    assert two.sent == ["a.py::1", "a.py::2"]
    finish(scheduler, one, "c.py::1")
    assert len(one.sent) == 3  # two tests left: nothing more yet
    finish(scheduler, one, "c.py::2")
    assert one.sent[3:] == ["b.py::1"] and not scheduler.tests_finished
    finish(scheduler, two, "a.py::1")
    assert two.sent[2:] == ["d.py::1"] and two.shutting_down  # nothing left to give
    finish(scheduler, one, "c.py::3")
    assert one.shutting_down  # told at its next finished test
    finish(scheduler, two, "a.py::2")
    assert scheduler.tests_finished and scheduler.has_pending  # each runs its last test
    finish(scheduler, one, "b.py::1")
    finish(scheduler, two, "d.py::1")
    assert not scheduler.has_pending
    assert scheduler.remove_node(one) is None and scheduler.remove_node(two) is None


def test_a_single_test_unit_comes_with_the_next_so_that_the_worker_can_run_it():
    worker = Worker("gw0")
    started([worker], first=["b.py::1"])
    assert worker.sent == ["b.py::1", "a.py::1", "a.py::2"]


def test_the_third_worker_takes_waiting_units_only_and_the_others_take_them_last():
    one, two, three = Worker("gw0"), Worker("gw1"), Worker("gw2")
    scheduler = started([one, two, three], first=["c"], waiting=["a"])
    assert one.sent == ["c.py::1", "c.py::2", "c.py::3"]
    assert two.sent == ["b.py::1", "d.py::1"] and not two.shutting_down  # "a" was left
    assert three.sent == ["a.py::1", "a.py::2"] and three.shutting_down
    finish(scheduler, two, "b.py::1")
    assert two.shutting_down
    one, two, three = Worker("gw0"), Worker("gw1"), Worker("gw2")
    scheduler = started([one, two, three], first=["c"], waiting=["a", "d.py::1"])
    assert two.sent == ["b.py::1", "a.py::1", "a.py::2"]  # nothing else was left
    assert three.sent == ["d.py::1"] and three.shutting_down
    # with no waiting unit left, the third takes a unit that starts no job (not a first one)
    one, three = Worker("gw0"), Worker("gw2")
    started([one, Worker("gw1"), three], first=["c", "a"], waiting=["d.py::1"])
    assert one.sent == ["c.py::1", "c.py::2", "c.py::3"]
    assert three.sent == ["d.py::1", "b.py::1"]
    one = Worker("gw0")
    started([one, Worker("gw1")], waiting=["a", "b.py::1", "c", "d.py::1"])
    assert one.sent == ["a.py::1", "a.py::2"]  # two workers: no waiting worker


def test_a_crashed_worker_names_its_test_and_its_other_tests_go_to_its_replacement():
    one, two = Worker("gw0"), Worker("gw1")
    scheduler = started([one, two], first=["c"])
    finish(scheduler, one, "c.py::1")
    assert scheduler.remove_node(one) == "c.py::2"  # crashed while running it
    three = Worker("gw2")
    scheduler.add_node(three)
    scheduler.add_node_collection(three, TESTS)
    scheduler.schedule()
    assert three.sent == ["c.py::3", "b.py::1"]
    finish(scheduler, two, "a.py::1")
    assert two.sent == ["a.py::1", "a.py::2", "d.py::1"]


def test_workers_that_collected_different_tests_fail_the_collection():
    reports = []
    hook = SimpleNamespace(pytest_collectreport=lambda report: reports.append(report))
    config = SimpleNamespace(getoption=lambda name: ["popen", "popen"], hook=hook)
    scheduler = UnitScheduling(config, lambda: (UNITS, [], []))
    one, two = Worker("gw0"), Worker("gw1")
    for worker, tests in [(one, TESTS), (two, TESTS[:-1])]:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, tests)
    scheduler.schedule()
    assert not one.sent and not two.sent
    assert "d.py::1" in reports[0].longrepr and reports[0].outcome == "failed"
