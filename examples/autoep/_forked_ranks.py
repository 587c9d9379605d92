# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Fork CPU ranks over gloo from a process that has already imported torch, DeepSpeed and transformers.

Importing them costs tens of seconds per process on a small CPU machine; forked ranks inherit them instead.
Used by ``run_demo.py`` and ``test_train_trainer.py``:

    codes, message, port = run_forked_ranks(world_size, body, timeout)

``body(rank, world_size, port)`` runs in each forked child after ``become_rank`` has set the rendezvous
variables; whatever it does, the child then exits with the script's exit code (0 when ``body`` returns).
"""

import os
import signal
import socket
import sys
import time
import traceback


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_rank(rank, world_size, port):
    """The environment torch.distributed's env:// rendezvous reads; no LOCAL_SIZE, so no /dev/shm buffers."""
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    os.environ.pop("LOCAL_SIZE", None)


def redirect_output(path):
    """Send this process's stdout and stderr (the file descriptors, so C++ output too) to ``path``."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _child(rank, world_size, port, body):
    """In a forked child: run ``body`` as rank ``rank``; never returns."""
    code = 1
    try:
        become_rank(rank, world_size, port)
        body(rank, world_size, port)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked_ranks(world_size, body, timeout):
    """Fork ``world_size`` ranks running ``body``; return {rank: exit code}, None or why the run failed, and the
    rendezvous port (the name of any /dev/shm buffer a rank mapped contains it).

    When a rank fails, the others are given 5 s to fail on their own, then killed (they wait in a collective
    that will never complete), as is every rank still running after ``timeout`` seconds.
    """
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _child(rank, world_size, port, body)
        pids.append(pid)

    codes = {}
    deadline = time.monotonic() + timeout
    message = None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        failed = {r: c for r, c in codes.items() if c != 0}
        if failed or time.monotonic() > deadline:
            rank = min(failed) if failed else None
            message = (f"rank {rank} exited with {failed[rank]}" if failed else f"timed out after {timeout:.0f} s")
            time.sleep(5 if failed else 0)
            for r, pid in enumerate(pids):
                if r not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[r] = -signal.SIGKILL
            break
        time.sleep(0.2)
    return codes, message, port
