# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Run a training script unchanged while counting the bytes that go through ``deepspeed.comm.all_to_all_single``.

    python _count_a2a.py COUNTS_JSON SCRIPT [SCRIPT_ARGS...]

The wrapper replaces ``deepspeed.comm.all_to_all_single`` (the function AutoEP's default path and the
``dedup`` transport call) with a counting one, then executes SCRIPT as ``__main__``. At the end, each rank
writes ``{"rank", "calls", "bytes_total", "bytes_to_other_ranks"}`` to COUNTS_JSON with ``{rank}`` replaced
by its rank. ``bytes_to_other_ranks`` leaves out the slice a rank "sends" to itself, which never crosses a
link. Transports that move data with their own kernels (DeepEP) are not seen here.
"""

import inspect
import json
import os
import runpy
import sys


def _all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
    """The parameters of ``deepspeed.comm.all_to_all_single`` (its decorator hides them from ``inspect``)."""


_A2A_SIGNATURE = inspect.signature(_all_to_all_single)


class AllToAllCounter:

    def __init__(self):
        self.calls = 0
        self.bytes_total = 0
        self.bytes_to_other_ranks = 0

    def install(self):
        import deepspeed.comm as dist

        original = dist.all_to_all_single

        def counting_all_to_all_single(*args, **kwargs):
            bound = _A2A_SIGNATURE.bind(*args, **kwargs)
            self._count(dist, bound.arguments["tensor"], bound.arguments.get("input_split_sizes"),
                        bound.arguments.get("group"))
            return original(*args, **kwargs)

        dist.all_to_all_single = counting_all_to_all_single

    def _count(self, dist, tensor, input_split_sizes, group):
        nbytes = tensor.numel() * tensor.element_size()
        group_size = dist.get_world_size(group=group)
        group_rank = dist.get_rank(group=group)
        rows = tensor.shape[0] if tensor.dim() > 0 else 1
        if input_split_sizes is None:
            own_rows = rows // group_size
        else:
            own_rows = int(input_split_sizes[group_rank])
        own_bytes = nbytes * own_rows // rows if rows else 0
        self.calls += 1
        self.bytes_total += nbytes
        self.bytes_to_other_ranks += nbytes - own_bytes

    def as_dict(self, rank):
        return {
            "rank": rank,
            "calls": self.calls,
            "bytes_total": self.bytes_total,
            "bytes_to_other_ranks": self.bytes_to_other_ranks
        }


def run(counts_path, script, script_args):
    """Execute ``script`` as ``__main__`` with ``script_args``; write this rank's counts afterwards."""
    counter = AllToAllCounter()
    counter.install()
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        rank = int(os.environ.get("RANK", "0"))
        with open(counts_path.format(rank=rank), "w") as f:
            json.dump(counter.as_dict(rank), f)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
