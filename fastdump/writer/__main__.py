"""Writer process entry point: ``python -m fastdump.writer --shm NAME [--priority idle|normal]``.

stdin is a pipe from the serving process (EOF = it died); stdout is a pipe back (our exit closes
it). Nothing is ever written to either, and the writer never imports torch.
"""

import argparse
import gc
import logging
import os
import signal
import sys

log = logging.getLogger("fastdump.writer")


def lower_priority(priority: str) -> None:
    """``idle``: run only on CPU time the serving process leaves unused (SCHED_IDLE).

    At normal priority the writer preempts one of torch's intra-op threads, and the other threads
    then wait for it at every barrier: a 2-core CPU decode slowed 1.3x for a writer using 0.3 of
    a core (benchmarks/RESULTS.md). Under SCHED_IDLE a waking model thread always preempts the
    writer. If the model never leaves a CPU idle, the ring fills and the producer sleeps in
    back-pressure, which frees the CPU the writer needs.
    Called once the first attach's open is acked (see settle), not at start: under SCHED_IDLE a
    machine other processes keep busy gives a process about 1-2 ms of CPU a second (measured), and
    the writer's imports and first handshake need several hundred ms of it: attach waited up to its
    60 s start timeout, or gave up on the open's ack. Only the calling thread is lowered (Linux
    policies are per thread); one it starts later inherits the policy.
    """
    if priority != "idle":
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or a seccomp profile that forbids it
        log.warning("fastdump writer: cannot switch to SCHED_IDLE (%s); running at normal priority", exc)


def settle(priority: str) -> None:
    """The writer has attached and acked its first control record (the first attach's open): what
    it does from now on (tensors, segments) is the work to keep out of the model's way. Its I/O
    threads are made first, at the priority it started with (the serving process's), which they
    keep: they only wait on the disk, and an idle-priority one, once lowered, cannot come back
    without CAP_SYS_NICE (EPERM for an ordinary user: they stayed SCHED_IDLE). They are made after
    the first open, which pins this thread near its GPU (devices.pin_writer_near), so they inherit
    that pinning too. Never raises: the loop goes on at whatever priority it has."""
    from . import segment_file

    segment_file.start_io_threads()
    lower_priority(priority)


def main() -> int:
    parser = argparse.ArgumentParser(prog="fastdump.writer")
    parser.add_argument("--shm", required=True)
    parser.add_argument("--priority", choices=("idle", "normal"), default="idle")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    # At the serving process's priority until the first attach's open is acked (settle): an
    # idle-priority start on a busy machine took most of a minute to import and map the ring.

    from .. import _C
    from .loop import run_consumer

    # Everything imported so far lives as long as the process; a collection every 700 record tuples
    # would walk it again and again (a few % of the writer's CPU). Collect rarely, and never it.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    # Only the serving process's fate ends us; a Ctrl-C sent to its group must not cut the drain.
    # Nor a SIGHUP: we lead our own process group, which the serving process's death orphans, and
    # the kernel then sends SIGHUP (and SIGCONT) to it if we are stopped; it killed us with every
    # pass still in the open segment. A hangup of the terminal reaches the serving process instead.
    # And our own process group is a background one of the serving terminal: under `stty tostop`
    # our first log line there would stop us (SIGTTOU) for good. Ignored, the write goes through.
    # Nor a SIGTERM: a service manager stopping the service (systemd's default KillMode) sends it
    # to every process of the service at once; it killed us with the passes buffered for the open
    # segment while the serving process's own SIGTERM handler was still closing its Dumpers, and
    # every one of them was lost. The serving process's close (or death) still ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    producer_pipe = os.dup(sys.stdin.fileno())
    sys.stdout = sys.stderr  # keep stray prints off the liveness pipe
    consumer = _C.Consumer(args.shm)
    consumer.set_producer_fd(producer_pipe)
    return run_consumer(consumer, pin_near_device=True, on_first_ack=lambda: settle(args.priority))


if __name__ == "__main__":
    sys.exit(main())
