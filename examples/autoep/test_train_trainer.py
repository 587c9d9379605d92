# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""``train_trainer.py`` trains every AutoEP router and expert through Hugging Face's ``Trainer``, with each transport.

Run by ``scripts/test.sh`` after the series' own tests, with the patched DeepSpeed installed:

    OMP_NUM_THREADS=1 python -m pytest -q examples/autoep/test_train_trainer.py

Each run is the unchanged script on 2 CPU ranks over gloo for a few optimizer steps; only
``DEEPSPEED_AUTOEP_COMM_BACKEND`` and the ZeRO stage differ. The ``deepep`` run uses the CPU stand-in of DeepEP's
``ElasticBuffer`` that the series' tests use (``tests/unit/moe/autoep/deep_ep_standin.py`` of the materialized tree,
or the file ``DEEP_EP_STANDIN`` names). The checks:

- the model was converted (router parameters exist only in AutoEP layers) and every router and expert parameter
  changed on some rank: Hugging Face's Trainer hands ``deepspeed.initialize`` its own param groups, and a fork that
  leaves them pointing at the replaced MoE blocks trains attention and norms only, while its loss still falls;
- every step's loss matches the default transport's within bf16's relative tolerance (1.6e-2, as in the demo);
- ``--model qwen3_5_moe`` (a gated shared expert) with ``DEEPSPEED_AUTOEP_COMM_OVERLAP=shared_experts`` trains with
  the same losses as without it, on every transport: the variable is the only change;
- with ``expert_parallel.load_balance_coeff`` in its config, the script trains every router and expert parameter,
  and every AutoEP layer's routing bias moved and is the same on both ranks.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from _forked_ranks import redirect_output, run_forked_ranks

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "train_trainer.py"
BACKEND_ENV = "DEEPSPEED_AUTOEP_COMM_BACKEND"
OVERLAP_ENV = "DEEPSPEED_AUTOEP_COMM_OVERLAP"
STEPS = 6
RTOL = 1.6e-2  # torch.testing.assert_close's rtol for bfloat16
TIMEOUT_S = 600
MIN_CHANGED_FRACTION = 0.9


def standin_path():
    path = Path(os.environ.get("DEEP_EP_STANDIN", REPO / "build/deepspeed/tests/unit/moe/autoep/deep_ep_standin.py"))
    if not path.is_file():
        pytest.fail(f"the DeepEP stand-in {path} does not exist: run scripts/test.sh (it materializes the tree), "
                    "or point DEEP_EP_STANDIN at the file")
    return path


def run_script(run_dir, env, argv, path_first=None, world_size=2):
    """Fork ``world_size`` ranks of the script; return rank 0's report, or fail with the failing rank's log."""

    def body(rank, world_size, port):
        import runpy
        os.environ.pop(BACKEND_ENV, None)
        os.environ.pop(OVERLAP_ENV, None)
        os.environ.update(env)
        redirect_output(run_dir / f"rank{rank}.log")
        if path_first:
            sys.path.insert(0, path_first)
        sys.argv = [str(SCRIPT), *argv]
        runpy.run_path(str(SCRIPT), run_name="__main__")

    codes, message, _ = run_forked_ranks(world_size, body, TIMEOUT_S)
    if message is not None:
        rank = min(r for r, c in codes.items() if c != 0)
        tail = (run_dir / f"rank{rank}.log").read_text()[-6000:]
        pytest.fail(f"{message} (env {env}, args {argv}); rank {rank}'s log ends:\n{tail}")
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def preimported():
    # Forked ranks inherit these, instead of importing them again each (tens of seconds on a small machine).
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401
    import accelerate  # noqa: F401


@pytest.fixture(scope="module")
def runs():
    """One run per (transport, ZeRO stage), shared by the tests below."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        standin_dir = Path(tmp, "standin")
        standin_dir.mkdir()
        (standin_dir / "deep_ep.py").symlink_to(standin_path())

        def run(name, env, zero_stage, path_first=None, model=None, config=None):
            run_dir = Path(tmp, f"{name}-z{zero_stage}-{model}-{env.get(OVERLAP_ENV)}")
            run_dir.mkdir()
            argv = (["--deepspeed-config", config] if config else []) + [
                "--steps",
                str(STEPS), "--zero-stage",
                str(zero_stage), "--output-dir",
                str(run_dir / "out"), "--report",
                str(run_dir / "report.json")
            ] + (["--model", model] if model else [])
            key = (name, zero_stage) if model is None else (name, model, env.get(OVERLAP_ENV, "none"))
            results[key] = run_script(run_dir, env, argv, path_first)

        run("default", {}, 0)
        run("default", {}, 1)
        # The example's config with one key added: auxiliary-loss-free load balancing.
        balanced = json.loads((HERE / "ds_config_trainer.json").read_text())
        balanced["expert_parallel"]["load_balance_coeff"] = 0.01
        Path(tmp, "balanced.json").write_text(json.dumps(balanced))
        run("balanced", {}, 1, config=str(Path(tmp, "balanced.json")))
        run("dedup", {BACKEND_ENV: "dedup"}, 0)
        # The stand-in is found first on the path (`import deep_ep`); nothing else of the run differs.
        run("deepep", {BACKEND_ENV: "deepep"}, 0, path_first=str(standin_dir))
        # Qwen3.5-MoE (a gated shared expert) on every transport, without and with the shared expert overlapped.
        for name, env, path_first in (("default", {}, None), ("dedup", {BACKEND_ENV: "dedup"}, None),
                                      ("deepep", {BACKEND_ENV: "deepep"}, str(standin_dir))):
            for overlap in (None, "shared_experts"):
                overlap_env = dict(env, **({OVERLAP_ENV: overlap} if overlap else {}))
                run(name, overlap_env, 0, path_first, model="qwen3_5_moe")
        yield results


@pytest.mark.parametrize("name,zero_stage", [("default", 0), ("default", 1), ("dedup", 0), ("deepep", 0),
                                             ("balanced", 1)])
def test_every_router_and_expert_parameter_trains(runs, name, zero_stage):
    change = runs[(name, zero_stage)]["max_change"]
    routers = [n for n in change if ".router." in n]
    experts = [n for n in change if ".experts." in n]
    assert routers and experts, f"no AutoEP router or expert parameters: the model was not converted ({sorted(change)})"
    untrained = sorted(n for n, c in change.items() if not c > 0)
    assert not untrained, f"{len(untrained)} of {len(change)} router/expert parameters never changed: {untrained}"
    # Every expert sees tokens at every step here, so nearly every element of every expert (on every rank) moves.
    fraction = runs[(name, zero_stage)]["changed_fraction"]
    stale = {n: f for n, f in fraction.items() if not f >= MIN_CHANGED_FRACTION}
    assert not stale, f"router/expert parameters with under {MIN_CHANGED_FRACTION:.0%} of elements changed: {stale}"
    # The environment variable reached every AutoEP layer: the run tested the transport it names.
    assert runs[(name, zero_stage)]["transports"] == ["comm" if name in ("default", "balanced") else name]


@pytest.mark.parametrize("name,zero_stage", [("default", 1), ("dedup", 0), ("deepep", 0)])
def test_losses_match_the_default_transport(runs, name, zero_stage):
    reference = runs[("default", 0)]["losses"]
    losses = runs[(name, zero_stage)]["losses"]
    assert len(losses) == len(reference) == STEPS
    for step, (got, want) in enumerate(zip(losses, reference), 1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got} vs the default's {want}"


@pytest.mark.parametrize("name", ["default", "dedup", "deepep"])
def test_overlapping_the_shared_expert_trains_qwen3_5_moe_exactly_as_without(runs, name):
    without, overlapped = runs[(name, "qwen3_5_moe", "none")], runs[(name, "qwen3_5_moe", "shared_experts")]
    # The variable reached every AutoEP layer, and the layers kept their transport.
    assert without["overlaps"] == ["none"] and overlapped["overlaps"] == ["shared_experts"]
    assert without["transports"] == overlapped["transports"] == ["comm" if name == "default" else name]
    assert len(without["losses"]) == STEPS and overlapped["losses"] == without["losses"]
    # The shared expert and its gate are trained too, like every router and expert parameter.
    change = overlapped["max_change"]
    assert [n for n in change if ".shared_experts" in n] and all(c > 0 for c in change.values()), change


def test_the_routing_biases_move_alike_on_every_rank_with_load_balance_coeff(runs):
    balanced, default = runs[("balanced", 1)], runs[("default", 1)]
    # No bias without the key; with it, one per AutoEP layer (both MoE blocks), moved and the same on both ranks.
    assert default["routing_biases"] == {} and default["biases_agree"] is None
    biases = balanced["routing_biases"]
    assert len(biases) == 2 and all(any(value != 0 for value in bias) for bias in biases.values()), biases
    assert balanced["biases_agree"] is True
    assert len(balanced["losses"]) == STEPS
