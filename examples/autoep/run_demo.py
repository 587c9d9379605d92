# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Run ``train.py`` unchanged once per AutoEP expert all-to-all transport and dispatch dtype and compare the runs.

For each transport (``comm``, the default; ``dedup``; ``hierarchical``, with the ranks split into two nodes by
``DEEPSPEED_AUTOEP_COMM_RANKS_PER_NODE``; ``deepep`` when ``import deep_ep`` works) and each
``--dispatch-dtypes`` (``bf16``, then ``fp8_e4m3``: the dispatch as e4m3 values and block scales) the driver
starts ``--world-size`` CPU ranks over gloo with ``DEEPSPEED_AUTOEP_COMM_BACKEND`` and
``DEEPSPEED_AUTOEP_COMM_DISPATCH_DTYPE`` set accordingly, the only difference between the runs. It then prints a Markdown table (final loss, largest loss difference from
the default path over all steps, median step time, all-to-all bytes per step), writes a loss-curve plot and
exits non-zero when a run fails or when a transport's losses leave the bf16 tolerance.

    python examples/autoep/run_demo.py [--out-dir build/demo] [--world-size 4] [-- TRAIN_ARGS...]

Ranks are forked from this process after it has imported torch, DeepSpeed and transformers once (importing
them costs tens of seconds per process on a small CPU machine); each rank then executes ``train.py`` as
``__main__`` through ``_count_a2a.py``, which counts the bytes passed to ``deepspeed.comm.all_to_all_single``.
``LOCAL_SIZE`` stays unset, so DeepSpeed's CPU shared-memory all-reduce maps no ``/dev/shm`` buffers; any
``deepspeed_allreduce_buffer_*`` file of a run's port is removed after the run all the same.

Tolerance. Every transport computes the same routing and expert math; they differ in the order in which bf16
values are summed (``dedup`` adds a token's local expert outputs on the expert's rank and rounds that partial
sum to bf16 before sending it back), and training carries those roundings forward through the weights. The
check allows, at every step, |loss - default loss| <= ``--rtol`` x default loss, with rtol = 1.6e-2 (about
2**-6: four roundings of bf16's 8-bit significand), the relative tolerance ``torch.testing.assert_close`` uses
for bf16. On the demo's 30 steps the transports differ by under 0.5 %; a routing or combine bug (a lost expert,
weights applied twice) moves the loss by far more than that within a few steps.

An FP8 dispatch rounds each element the experts receive by up to 2**-4 of its value (e4m3's 3-bit significand)
instead of bf16's 2**-9, and training carries that forward too; its runs are held to ``--fp8-rtol``, 2**-4 by
default: a loss further than one e4m3 rounding from the default path's would mean the dispatch's error grew
during training instead of staying at one rounding per element.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _forked_ranks import redirect_output, run_forked_ranks

# Before torch is imported: one thread per rank, and no LOCAL_SIZE (no /dev/shm all-reduce buffers).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.pop("LOCAL_SIZE", None)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = HERE / "train.py"
DS_CONFIG = HERE / "ds_config.json"
TRANSPORTS = ("comm", "dedup", "hierarchical", "deepep")
DEFAULT = "comm"
BACKEND_ENV = "DEEPSPEED_AUTOEP_COMM_BACKEND"
DISPATCH_ENV = "DEEPSPEED_AUTOEP_COMM_DISPATCH_DTYPE"
RANKS_PER_NODE_ENV = "DEEPSPEED_AUTOEP_COMM_RANKS_PER_NODE"
DISPATCH_DTYPES = ("bf16", "fp8_e4m3")
FP8 = "fp8_e4m3"
DEFAULT_RTOL = 1.6e-2  # torch.testing.assert_close's rtol for bfloat16
DEFAULT_FP8_RTOL = 2**-4  # e4m3's relative rounding bound per element: see the module docstring


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "build" / "demo")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, in run order")
    parser.add_argument("--dispatch-dtypes",
                        default=",".join(DISPATCH_DTYPES),
                        help=f"comma-separated {DISPATCH_ENV} values; each runs every transport")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="allowed |loss - default loss| / loss")
    parser.add_argument("--fp8-rtol",
                        type=float,
                        default=DEFAULT_FP8_RTOL,
                        help="the same, for runs with an FP8 dispatch")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: extra arguments for train.py")
    args = parser.parse_args()
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    return args


def deep_ep_unavailable():
    """None when ``import deep_ep`` works (checked in a child: it may initialise CUDA), else the reason."""
    result = subprocess.run([sys.executable, "-c", "import deep_ep"], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"`import deep_ep` exited with {result.returncode}"


def run_name(transport, dispatch):
    return transport if dispatch == "bf16" else f"{transport}+fp8"


def launch(transport, dispatch, world_size, run_dir, train_args, timeout):
    """Fork ``world_size`` ranks running train.py; returns (ok, message)."""

    def body(rank, world_size, port):
        import _count_a2a
        os.environ[BACKEND_ENV] = transport
        os.environ[DISPATCH_ENV] = dispatch
        if transport == "hierarchical":
            # Two simulated nodes: a token crosses between them once per destination node.
            os.environ[RANKS_PER_NODE_ENV] = str(world_size // 2)
        if rank != 0:  # rank 0 prints to the terminal, the others to their log files
            redirect_output(run_dir / f"rank{rank}.log")
        script_args = [
            "--deepspeed", "--deepspeed_config",
            str(DS_CONFIG), "--metrics-out",
            str(run_dir / "metrics.json"), *train_args
        ]
        _count_a2a.run(str(run_dir / "a2a_rank{rank}.json"), str(TRAIN), script_args)

    _, message, port = run_forked_ranks(world_size, body, timeout)
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        os.remove(path)
    return message is None, message


def run_one(args, transport, dispatch, name):
    """Train once with ``transport`` and ``dispatch``; the run's metrics, or why it failed."""
    run_dir = args.out_dir / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("*.json"):
        stale.unlink()
    print(
        f"\n== {name}: {BACKEND_ENV}={transport} {DISPATCH_ENV}={dispatch} {TRAIN.relative_to(REPO)} on "
        f"{args.world_size} gloo ranks (ranks 1.. log to {run_dir}/)",
        flush=True)
    started = time.monotonic()
    ok, message = launch(transport, dispatch, args.world_size, run_dir, args.train_args, args.timeout)
    elapsed = time.monotonic() - started
    if not ok:
        print(f"== {name}: FAILED after {elapsed:.0f} s: {message}; logs in {run_dir}/", flush=True)
        return {"failed": message}
    print(f"== {name}: done in {elapsed:.0f} s", flush=True)
    return load_run(run_dir, args.world_size)


def load_run(run_dir, world_size):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    counts = [json.loads((run_dir / f"a2a_rank{r}.json").read_text()) for r in range(world_size)]
    steps = len(metrics["loss"])
    return {
        "loss": metrics["loss"],
        "step_time_s": metrics["step_time_s"],
        "a2a_calls_per_step": sum(c["calls"] for c in counts) / steps,
        "a2a_bytes_per_step": sum(c["bytes_to_other_ranks"] for c in counts) / steps,
    }


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def table(results, rtol):
    base = results[DEFAULT]
    rows = [
        "| transport | dispatch | final loss | max \\|loss − default\\| (allowed) | median step time "
        "| all-to-all bytes / step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        transport, dispatch = r["transport"], r["dispatch"]
        if "skipped" in r or "failed" in r:
            rows.append(f"| `{transport}` | {dispatch} | {'skipped' if 'skipped' in r else 'FAILED'}: "
                        f"{r.get('skipped') or r['failed']} | | | |")
            continue
        label = f"`{transport}`" + (" (default)" if name == DEFAULT else "")
        if name == DEFAULT:
            diff = "—"
        else:
            diff = f"{r['max_abs_diff']:.4f} ({r['allowed']:.4f})"
        bytes_cell = fmt_bytes(r["a2a_bytes_per_step"])
        if name != DEFAULT and base.get("a2a_bytes_per_step"):
            bytes_cell += f" ({r['a2a_bytes_per_step'] / base['a2a_bytes_per_step']:.2f}x)"
        if transport == "deepep":
            bytes_cell = "not counted (DeepEP kernels)"
        rows.append(f"| {label} | {dispatch} | {r['loss'][-1]:.4f} | {diff} | "
                    f"{statistics.median(r['step_time_s']) * 1000:.0f} ms | {bytes_cell} |")
    return "\n".join(rows)


def plot(results, path, rtol, world_size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in results.items() if "loss" in v}
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {
        "comm": dict(lw=3, alpha=0.5),
        "dedup": dict(lw=1.2, ls="--"),
        "hierarchical": dict(lw=1.2, ls="-."),
        "deepep": dict(lw=1.2, ls=":")
    }
    for name, r in ran.items():
        steps = range(1, len(r["loss"]) + 1)
        style = dict(styles.get(r["transport"], {}), **(dict(marker=".") if r["dispatch"] == FP8 else {}))
        ax_loss.plot(steps, r["loss"], label=name + (" (default)" if name == DEFAULT else ""), **style)
        if name != DEFAULT:
            diff = [abs(a - b) for a, b in zip(r["loss"], ran[DEFAULT]["loss"])]
            ax_diff.plot(steps, diff, label=name, **style)
    if DEFAULT in ran:
        steps = range(1, len(ran[DEFAULT]["loss"]) + 1)
        ax_diff.plot(steps, [rtol * abs(v) for v in ran[DEFAULT]["loss"]], color="gray", lw=1, label="tolerance")
    ax_loss.set(xlabel="step", ylabel="training loss", title=f"Mixtral (AutoEP, bf16), {world_size} gloo ranks")
    ax_diff.set(xlabel="step", ylabel="|loss − default loss|", title="difference from the default all-to-all")
    ax_loss.legend()
    ax_diff.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    transports = [t.strip().lower() for t in args.transports.split(",") if t.strip()]
    if DEFAULT not in transports:
        sys.exit(f"--transports must include the default '{DEFAULT}', the reference for the loss comparison")
    transports.sort(key=lambda t: t != DEFAULT)
    dispatch_dtypes = [d.strip().lower() for d in args.dispatch_dtypes.split(",") if d.strip()]
    if dispatch_dtypes[:1] != ["bf16"] or not set(dispatch_dtypes) <= set(DISPATCH_DTYPES):
        sys.exit(f"--dispatch-dtypes must start with bf16 (the reference) and hold only {', '.join(DISPATCH_DTYPES)}")

    # Import once here; the forked ranks inherit the modules instead of importing them again.
    started = time.monotonic()
    sys.path.insert(0, str(HERE))
    import _count_a2a  # noqa: F401
    import deepspeed
    import tqdm  # noqa: F401
    from transformers import MixtralForCausalLM  # noqa: F401
    print(
        f"deepspeed {deepspeed.__version__} from {Path(deepspeed.__file__).parent}; "
        f"imports took {time.monotonic() - started:.0f} s",
        flush=True)
    # deepspeed.comm loads its CPU shared-memory op (JIT-compiled on first use, into TORCH_EXTENSIONS_DIR) in
    # every process; loading it here once lets the forked ranks reuse it instead of each running ninja.
    started = time.monotonic()
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)
        print(f"DeepSpeed CPU shared-memory op ready in {time.monotonic() - started:.0f} s", flush=True)

    results = {}
    deep_ep_reason = deep_ep_unavailable() if "deepep" in transports else None
    for dispatch in dispatch_dtypes:
        for transport in transports:
            name = run_name(transport, dispatch)
            if transport == "deepep" and deep_ep_reason is not None:
                print(f"\n== {name}: skipped, `import deep_ep` fails: {deep_ep_reason}", flush=True)
                results[name] = {"skipped": f"`import deep_ep` fails ({deep_ep_reason})"}
            else:
                results[name] = run_one(args, transport, dispatch, name)
            results[name].update(transport=transport, dispatch=dispatch)

    base = results.get(DEFAULT, {})
    failures = [f"{t}: {r['failed']}" for t, r in results.items() if "failed" in r]
    if "loss" in base:
        for name, r in results.items():
            if name == DEFAULT or "loss" not in r:
                continue
            if len(r["loss"]) != len(base["loss"]):
                failures.append(f"{name}: {len(r['loss'])} steps, default {len(base['loss'])}")
                continue
            rtol = args.fp8_rtol if r["dispatch"] == FP8 else args.rtol
            diffs = [abs(a - b) for a, b in zip(r["loss"], base["loss"])]
            excess = [(d - rtol * abs(b), i) for i, (d, b) in enumerate(zip(diffs, base["loss"]))]
            r["max_abs_diff"] = max(diffs)
            r["allowed"] = rtol * abs(base["loss"][diffs.index(max(diffs))])
            worst, step = max(excess)
            if worst > 0:
                failures.append(f"{name}: step {step + 1} loss {r['loss'][step]:.4f} vs default "
                                f"{base['loss'][step]:.4f}, beyond rtol {rtol:g}")

    print()
    if "loss" not in base:
        print(f"The default transport did not run, nothing to compare: {'; '.join(failures)}")
        return 1
    md = table(results, args.rtol)
    print(md)
    (args.out_dir / "results.md").write_text(md + "\n")
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    png = args.out_dir / "loss_curves.png"
    try:
        plot(results, png, args.rtol, args.world_size)
        curves = str(png)
    except ModuleNotFoundError as e:  # the table and the tolerance check do not need matplotlib
        curves = f"not plotted ({e}; pip install -r examples/autoep/requirements.txt)"
    print(f"\nall-to-all bytes: sent to other ranks through deepspeed.comm.all_to_all_single, all ranks, per step "
          f"(forward and backward).\nloss tolerance: |loss - default| <= {args.rtol:g} x default loss at every step "
          f"(bf16), {args.fp8_rtol:g} x with an FP8 dispatch (see run_demo.py).\nloss curves: {curves}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: every run matches the default path within its tolerance (bf16, or FP8 with an FP8 dispatch).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
