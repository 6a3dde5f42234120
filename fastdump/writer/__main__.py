"""Writer process entry point: ``python -m fastdump.writer --shm NAME``.

stdin is a pipe from the serving process (EOF = it died); stdout is a pipe back (our exit closes
it). Nothing is ever written to either, and the writer never imports torch.
"""

import argparse
import logging
import os
import signal
import sys

from .. import _C
from .loop import run_consumer


def main() -> int:
    parser = argparse.ArgumentParser(prog="fastdump.writer")
    parser.add_argument("--shm", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    # Only the serving process's fate ends us; a Ctrl-C sent to its group must not cut the drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    producer_pipe = os.dup(sys.stdin.fileno())
    sys.stdout = sys.stderr  # keep stray prints off the liveness pipe
    consumer = _C.Consumer(args.shm)
    consumer.set_producer_fd(producer_pipe)
    return run_consumer(consumer, pin_near_device=True)


if __name__ == "__main__":
    sys.exit(main())
