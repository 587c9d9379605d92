# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Run ``train.py`` unchanged once per AutoEP expert all-to-all transport and compare the runs.

For each transport (``comm``, the default; ``dedup``; ``deepep`` when ``import deep_ep`` works) the driver
starts ``--world-size`` CPU ranks over gloo with ``DEEPSPEED_AUTOEP_COMM_BACKEND`` set to that transport, the
only difference between the runs. It then prints a Markdown table (final loss, largest loss difference from
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
TRANSPORTS = ("comm", "dedup", "deepep")
DEFAULT = "comm"
BACKEND_ENV = "DEEPSPEED_AUTOEP_COMM_BACKEND"
DEFAULT_RTOL = 1.6e-2  # torch.testing.assert_close's rtol for bfloat16


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "build" / "demo")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, in run order")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="allowed |loss - default loss| / loss")
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


def launch(transport, world_size, run_dir, train_args, timeout):
    """Fork ``world_size`` ranks running train.py; returns (ok, message)."""

    def body(rank, world_size, port):
        import _count_a2a
        os.environ[BACKEND_ENV] = transport
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
        "| transport | final loss | max \\|loss − default\\| (allowed) | median step time | all-to-all bytes / step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "skipped" in r or "failed" in r:
            rows.append(f"| `{name}` | {'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r['failed']} "
                        "| | | |")
            continue
        label = f"`{name}`" + (" (default)" if name == DEFAULT else "")
        if name == DEFAULT:
            diff = "—"
        else:
            diff = f"{r['max_abs_diff']:.4f} ({r['allowed']:.4f})"
        bytes_cell = fmt_bytes(r["a2a_bytes_per_step"])
        if name != DEFAULT and base.get("a2a_bytes_per_step"):
            bytes_cell += f" ({r['a2a_bytes_per_step'] / base['a2a_bytes_per_step']:.2f}x)"
        if name == "deepep":
            bytes_cell = "not counted (DeepEP kernels)"
        rows.append(f"| {label} | {r['loss'][-1]:.4f} | {diff} | "
                    f"{statistics.median(r['step_time_s']) * 1000:.0f} ms | {bytes_cell} |")
    return "\n".join(rows)


def plot(results, path, rtol, world_size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in results.items() if "loss" in v}
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"comm": dict(lw=3, alpha=0.5), "dedup": dict(lw=1.2, ls="--"), "deepep": dict(lw=1.2, ls=":")}
    for name, r in ran.items():
        steps = range(1, len(r["loss"]) + 1)
        ax_loss.plot(steps, r["loss"], label=name + (" (default)" if name == DEFAULT else ""), **styles.get(name, {}))
        if name != DEFAULT:
            diff = [abs(a - b) for a, b in zip(r["loss"], ran[DEFAULT]["loss"])]
            ax_diff.plot(steps, diff, label=name, **styles.get(name, {}))
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
    for transport in transports:
        if transport == "deepep":
            reason = deep_ep_unavailable()
            if reason is not None:
                print(f"\n== deepep: skipped, `import deep_ep` fails: {reason}", flush=True)
                results["deepep"] = {"skipped": f"`import deep_ep` fails ({reason})"}
                continue
        run_dir = args.out_dir / transport
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("*.json"):
            stale.unlink()
        print(
            f"\n== {transport}: {BACKEND_ENV}={transport} {TRAIN.relative_to(REPO)} on {args.world_size} gloo "
            f"ranks (ranks 1.. log to {run_dir}/)",
            flush=True)
        started = time.monotonic()
        ok, message = launch(transport, args.world_size, run_dir, args.train_args, args.timeout)
        elapsed = time.monotonic() - started
        if not ok:
            print(f"== {transport}: FAILED after {elapsed:.0f} s: {message}; logs in {run_dir}/", flush=True)
            results[transport] = {"failed": message}
            continue
        results[transport] = load_run(run_dir, args.world_size)
        print(f"== {transport}: done in {elapsed:.0f} s", flush=True)

    base = results.get(DEFAULT, {})
    failures = [f"{t}: {r['failed']}" for t, r in results.items() if "failed" in r]
    if "loss" in base:
        for name, r in results.items():
            if name == DEFAULT or "loss" not in r:
                continue
            if len(r["loss"]) != len(base["loss"]):
                failures.append(f"{name}: {len(r['loss'])} steps, default {len(base['loss'])}")
                continue
            diffs = [abs(a - b) for a, b in zip(r["loss"], base["loss"])]
            excess = [(d - args.rtol * abs(b), i) for i, (d, b) in enumerate(zip(diffs, base["loss"]))]
            r["max_abs_diff"] = max(diffs)
            r["allowed"] = args.rtol * abs(base["loss"][diffs.index(max(diffs))])
            worst, step = max(excess)
            if worst > 0:
                failures.append(f"{name}: step {step + 1} loss {r['loss'][step]:.4f} vs default "
                                f"{base['loss'][step]:.4f}, beyond rtol {args.rtol:g}")

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
          f"(bf16; see run_demo.py).\nloss curves: {curves}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: every transport that ran matches the default path within the bf16 tolerance.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
