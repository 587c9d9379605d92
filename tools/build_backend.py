"""PEP 517 backend: `pip install .` (or `pip install git+<url>`) installs the patched DeepSpeed.

Each hook materializes the pinned sdist plus patches/ into a temporary directory with
tools/series.py, then delegates to upstream's own setuptools build there, so the installed package is
exactly upstream's build of the patched tree, versioned <base version>+<series tag>. Ops are left to JIT
compilation as upstream's default (DS_BUILD_OPS=0): no GPU and no CUDA toolkit are needed.
"""

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import series  # noqa: E402

_REPO = series.Repo(Path(__file__).resolve().parents[1])


def _build(kind, outdir):
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp, "deepspeed")
        # The tool logs to stderr; pip shows it with -v.
        series.materialize(_REPO, tree, force=True)
        with tempfile.TemporaryDirectory() as staging:
            name = series.run_setuptools(_REPO, tree, f"build_{kind}", Path(staging))
            shutil.move(Path(staging, name), Path(outdir, name))
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        return _build("wheel", wheel_directory)
    except series.SeriesError as e:
        raise SystemExit(f"deepspeed-fork: {e}")


def build_sdist(sdist_directory, config_settings=None):
    try:
        return _build("sdist", sdist_directory)
    except series.SeriesError as e:
        raise SystemExit(f"deepspeed-fork: {e}")
