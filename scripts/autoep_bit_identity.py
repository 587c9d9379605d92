"""Compare what two DeepSpeed trees compute and communicate through AutoEP, engine by engine.

    build/venv-test/bin/python scripts/autoep_bit_identity.py record TREE OUT.pt
    build/venv-test/bin/python scripts/autoep_bit_identity.py compare BEFORE.pt AFTER.pt

``record`` trains small AutoEP engines of TREE (a materialized tree with the series' tests, e.g. a `git worktree` of
build/deepspeed at some patch) on 2 and 4 gloo ranks, for every transport (comm, dedup, hierarchical on two nodes,
deepep through the tests' CPU stand-in) x comm_overlap (none, shared_experts, chunked with 3 chunks) x dispatch dtype (unquantized, FP8) x
ZeRO stage (0, 3), 3 steps each, and saves per rank: the losses, a checksum per parameter gradient after each
backward, and the collectives issued through deepspeed.comm per step, in order. ``compare`` says in how many
(configuration, rank) pairs the values and the collectives are identical, and lists the others. A refactoring
that claims bit-identity shows all of them identical. ``AUTOEP_BIT_IDENTITY_SCORE_APPLY=pre`` (or ``post``) records
engines with that ``expert_parallel.score_apply`` instead of their preset's (``post``).
"""

import collections
import os
import subprocess
import sys

import torch

CHUNKS = 3
STEPS = 3


def _run():
    import deepspeed.comm as dist
    from unit.moe.autoep.autoep_layers import build_engine, count_collectives, use_standin
    use_standin()
    rank, result = dist.get_rank(), {}
    for backend in ("comm", "dedup", "hierarchical", "deepep"):
        for overlap in ("none", "shared_experts", "chunked"):
            for dtype in ("bf16", "fp8_e4m3"):  # "bf16": the unquantized dispatch's first name, accepted by all
                for stage in (0, 3):
                    engine = build_engine(backend,
                                          stage=stage,
                                          hidden=256,
                                          ffn=64,
                                          bf16=True,
                                          shared="gated",
                                          environ={
                                              "DEEPSPEED_AUTOEP_COMM_OVERLAP": overlap,
                                              "DEEPSPEED_AUTOEP_COMM_DISPATCH_DTYPE": dtype
                                          },
                                          comm_overlap_chunks=CHUNKS,
                                          score_apply=os.environ.get("AUTOEP_BIT_IDENTITY_SCORE_APPLY", "auto"))
                    losses, checksums, calls = [], [], []
                    for step in range(STEPS):
                        torch.manual_seed(10 * step + rank)
                        x = torch.randn(1, 6 + 3 * rank, 256).to(torch.bfloat16)
                        y = torch.randn(1, 6 + 3 * rank).to(torch.bfloat16)
                        with count_collectives() as seen:
                            loss = engine(x, y)
                            engine.backward(loss)
                        calls.append(list(seen))
                        checksums.append([p.grad.float().sum().item() for p in engine.module.parameters()
                                          if p.grad is not None])
                        engine.step()
                        losses.append(loss.item())
                    engine.destroy()
                    result[backend, overlap, dtype, stage] = (losses, checksums, calls)
    return result


def record(out):
    from unit.multiprocess import run_on_ranks
    torch.save({world: run_on_ranks(_run, world, timeout=1500) for world in (2, 4)}, out)
    print(f"saved {out}")


def compare(before, after):
    a, b = torch.load(before), torch.load(after)
    total, same_values, same_calls, differing = 0, 0, 0, []
    for world in a:
        for rank, (ra, rb) in enumerate(zip(a[world], b[world])):
            for key in ra:
                (la, sa, ca), (lb, sb, cb) = ra[key], rb[key]
                values, calls = (la, sa) == (lb, sb), ca == cb
                total, same_values, same_calls = total + 1, same_values + values, same_calls + calls
                if not (values and calls):
                    differing.append((world, rank, key, "values" * (not values), "collectives" * (not calls)))
    print(f"{total} (configuration, rank) pairs: values identical in {same_values}, collectives in {same_calls}")
    for (backend, overlap, dtype, stage), count in collections.Counter(d[2] for d in differing).items():
        what = sorted({d[3] or d[4] for d in differing if d[2] == (backend, overlap, dtype, stage)})
        print(f"  differ: {backend} {overlap} {dtype} ZeRO-{stage}: {', '.join(what)} ({count} ranks)")


def main():
    if sys.argv[1:2] == ["record"] and len(sys.argv) == 4:
        tree = os.path.abspath(sys.argv[2])
        if os.environ.get("AUTOEP_BIT_IDENTITY_TREE") != tree:  # run again with TREE first on the path
            env = dict(os.environ,
                       AUTOEP_BIT_IDENTITY_TREE=tree,
                       PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "tests")]),
                       OMP_NUM_THREADS="1",
                       TORCH_EXTENSIONS_DIR=os.path.join(tree, ".torch_extensions"))
            sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env=env))
        record(sys.argv[3])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
