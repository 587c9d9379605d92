#!/usr/bin/env bash
# The main command (README): install this fork with pip into build/venv-demo, as a user would, show that the
# installed deepspeed is the patched one, then train a small Mixtral with AutoEP on 4 CPU ranks once per expert
# all-to-all transport (examples/autoep/run_demo.py): a table of losses, step times and all-to-all bytes, and a
# loss-curve plot in build/demo/. Fails when a transport's losses leave the bf16 tolerance.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/venv-demo
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check torch==2.13.0
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps .
"$py" -m pip install -q --disable-pip-version-check .
"$py" -m pip install -q --disable-pip-version-check -r examples/autoep/requirements.txt
(
  cd build  # import the installed package, not a source tree
  "../$venv/bin/python" - <<'PY'
import importlib.metadata, logging
logging.disable(logging.WARNING)
import deepspeed
print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}")
assert "+series" in deepspeed.__version__, "not the fork's build"
PY
  echo "series applied: $(python3 ../tools/series.py tag)"
  grep -v '^#' ../patches/series | sed 's/^/  /'
)

# DeepSpeed JIT-compiles its CPU ops against this venv's torch: keep them with the venv, so that other
# environments on the machine sharing ~/.cache/torch_extensions neither rebuild nor overwrite them.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$venv/torch_extensions}"
echo
echo "== AutoEP demo: examples/autoep/train.py, unchanged, once per DEEPSPEED_AUTOEP_COMM_BACKEND"
exec "$py" examples/autoep/run_demo.py --out-dir build/demo
