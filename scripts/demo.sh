#!/usr/bin/env bash
# The main command (README): install this fork with pip into build/venv-demo, as a user would, and
# show that the installed deepspeed is the patched one.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/venv-demo
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check torch==2.13.0
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps .
"$py" -m pip install -q --disable-pip-version-check .
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
