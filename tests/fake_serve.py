"""`msinfer serve`'s rank 0 (api_server.serve) over the fake engine, as a process of its own,
for tests of its signal handling: python tests/fake_serve.py PORT DIR STEP_DELAY.

Warm-up writes DIR/warming, then waits until DIR/release exists: the test decides when
warm-up ends, so what a signal does during it is not a race against a clock."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_engine import fake_llm  # noqa: E402

from msinfer import log  # noqa: E402
from msinfer.server.api_server import serve  # noqa: E402
from msinfer.server.server_config import ServerConfig  # noqa: E402


def main(port, directory, step_delay):
    llm = fake_llm(step_delay=float(step_delay), max_model_len=200, num_blocks=64,
                   max_num_seqs=4)

    def warmup(on_shape=None):
        open(os.path.join(directory, "warming"), "w").close()
        while not os.path.exists(os.path.join(directory, "release")):
            time.sleep(0.01)
    llm.warmup = warmup
    log.setup()
    return serve(llm, ServerConfig(model_names=["fake"], port=int(port), shutdown_timeout=60,
                                   stall_timeout=30))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
