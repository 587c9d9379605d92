"""Tests of tools/series.py on a small stand-in upstream sdist (no network, no DeepSpeed)."""

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import series  # noqa: E402
from series import SeriesError  # noqa: E402

UPSTREAM_FILES = {
    "pkg/__init__.py": "# SPDX-License-Identifier: Apache-2.0\n#\n# DeepSpeed Team\n\nVALUE = 1\n",
    "pkg/util.py": "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(10)),
    "README.md": "upstream\n",
    "build.txt": "",  # as in DeepSpeed's sdist: setup.py appends it to the version
}


def make_sdist(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"pkg-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sh(cwd, *args):
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A fork repository (a git repo) whose upstream is a tiny sdist already in the cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    sha = make_sdist(cache / "pkg-1.0.tar.gz", UPSTREAM_FILES)
    monkeypatch.setenv("DSFORK_CACHE", str(cache))
    root = tmp_path / "fork"
    (root / "patches").mkdir(parents=True)
    (root / "upstream.toml").write_text(f'[upstream]\npackage = "pkg"\nversion = "1.0"\n'
                                        f'sdist = "pkg-1.0.tar.gz"\nsha256 = "{sha}"\n')
    (root / "patches" / "series").write_text("# order of the patches\n")
    (root / ".gitignore").write_text("/build/\n")
    sh(root, "git", "init", "-q")
    return series.Repo(root)


def commit(tree, path, text, message="Change a thing\n\nBecause it is needed.", signoff=True):
    Path(tree, path).write_text(text)
    sh(tree, "git", "add", path)
    args = ["git", "-c", "user.name=Dev", "-c", "user.email=dev@example.com", "commit", "-q", "-m", message]
    sh(tree, *(args + ["-s"] if signoff else args))


def add_two_patches(repo):
    series.materialize(repo, repo.tree)
    commit(repo.tree, "pkg/__init__.py", UPSTREAM_FILES["pkg/__init__.py"] + "OTHER = 2\n", "Add OTHER\n\nFor users.")
    commit(repo.tree, "pkg/new.py", "# SPDX-License-Identifier: Apache-2.0\n#\n# DeepSpeed Team\n\nX = 3\n",
           "Add pkg.new\n\nA new module.")
    return series.export(repo, repo.tree)


def test_round_trip_is_byte_stable(repo):
    names = add_two_patches(repo)
    assert names == ["0001-Add-OTHER.patch", "0002-Add-pkg.new.patch"]
    assert series.read_series(repo) == names
    sh(repo.root, "git", "add", "-A")
    sh(repo.root, "git", "-c", "user.name=D", "-c", "user.email=d@e", "commit", "-q", "-m", "patches")
    before = {n: (repo.patches / n).read_bytes() for n in names}

    series.materialize(repo, repo.tree)  # exported, so nothing to lose
    head = sh(repo.tree, "git", "rev-parse", "HEAD")
    series.materialize(repo, repo.tree)
    assert sh(repo.tree, "git", "rev-parse", "HEAD") == head, "commit ids must repeat"
    assert sh(repo.tree, "git", "tag", "--points-at", "HEAD~2").strip() == "base"
    series.export(repo, repo.tree)
    assert {n: (repo.patches / n).read_bytes() for n in names} == before
    assert sh(repo.root, "git", "status", "--porcelain") == ""
    text = before[names[0]].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "\n-- \n" not in text, "no git-version signature"
    series.check(repo)


def test_export_removes_patches_without_commit(repo):
    add_two_patches(repo)
    sh(repo.tree, "git", "reset", "-q", "--hard", "HEAD~1")
    assert series.export(repo, repo.tree) == ["0001-Add-OTHER.patch"]
    assert sorted(p.name for p in repo.patches.glob("*.patch")) == ["0001-Add-OTHER.patch"]
    assert series.read_series(repo) == ["0001-Add-OTHER.patch"]


def test_materialize_refuses_uncommitted_work(repo):
    series.materialize(repo, repo.tree)
    (repo.tree / "pkg" / "util.py").write_text("edited\n")
    with pytest.raises(SeriesError, match="uncommitted changes(.|\n)*pkg/util.py"):
        series.materialize(repo, repo.tree)
    assert (repo.tree / "pkg" / "util.py").read_text() == "edited\n"
    series.materialize(repo, repo.tree, force=True)
    assert (repo.tree / "pkg" / "util.py").read_text() == UPSTREAM_FILES["pkg/util.py"]


def test_materialize_refuses_unexported_commits(repo):
    series.materialize(repo, repo.tree)
    commit(repo.tree, "pkg/util.py", "work\n")
    with pytest.raises(SeriesError, match="not exported to patches/"):
        series.materialize(repo, repo.tree)
    assert (repo.tree / "pkg" / "util.py").read_text() == "work\n"
    series.export(repo, repo.tree)
    series.materialize(repo, repo.tree)
    assert (repo.tree / "pkg" / "util.py").read_text() == "work\n"


def test_build_output_is_not_work(repo):
    series.materialize(repo, repo.tree)
    (repo.tree / "pkg" / "__pycache__").mkdir()
    (repo.tree / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"")
    (repo.tree / "pkg.egg-info").mkdir()
    (repo.tree / "pkg.egg-info" / "PKG-INFO").write_text("")
    series.materialize(repo, repo.tree)


def test_hash_mismatch_is_a_hard_error(repo):
    cached = Path(os.environ["DSFORK_CACHE"], "pkg-1.0.tar.gz")
    expected = repo.upstream().sha256
    actual = make_sdist(cached, {"pkg/__init__.py": "tampered\n"})
    with pytest.raises(SeriesError) as e:
        series.materialize(repo, repo.tree)
    assert str(cached) in str(e.value) and expected in str(e.value) and actual in str(e.value)
    assert not repo.tree.exists()


def test_patch_that_no_longer_applies_names_patch_and_file(repo):
    names = add_two_patches(repo)
    first = repo.patches / names[0]
    first.write_text(first.read_text().replace(" VALUE = 1", " VALUE = 100"))
    with pytest.raises(SeriesError, match=f"patches/{names[0]} does not apply(.|\n)*pkg/__init__.py"):
        series.materialize(repo, repo.tree)
    # The tree keeps what applied (base) and is not reported as unexported work afterwards.
    assert sh(repo.tree, "git", "rev-parse", "HEAD") == sh(repo.tree, "git", "rev-parse", "base")
    assert not (repo.tree / ".git" / "rebase-apply").exists()


def test_series_entry_without_file(repo):
    (repo.patches / "series").write_text("0001-missing.patch\n")
    with pytest.raises(SeriesError, match="series lists 0001-missing.patch, but patches/0001-missing.patch"):
        series.read_series(repo)


def test_patch_file_not_in_series(repo):
    (repo.patches / "0001-stray.patch").write_text("")
    with pytest.raises(SeriesError, match="patches/0001-stray.patch is not listed in patches/series"):
        series.materialize(repo, repo.tree)


def test_check_reports_missing_signoff_body_and_noncanonical_patch(repo):
    series.materialize(repo, repo.tree)
    commit(repo.tree, "pkg/util.py", UPSTREAM_FILES["pkg/util.py"] + "def g():\n    return 0\n", "Add g", False)
    series.export(repo, repo.tree)
    (name, ) = series.read_series(repo)
    path = repo.patches / name
    path.write_text(path.read_text() + "-- \n2.39.5\n\n")
    with pytest.raises(SeriesError) as e:
        series.check(repo)
    msg = str(e.value)
    assert "no Signed-off-by" in msg and "has no body" in msg and "not in canonical form" in msg


def test_check_enforces_upstream_rules(repo):
    series.materialize(repo, repo.tree)
    commit(repo.tree, "pkg/bad.py", "import torch.distributed\n\nx = torch.cuda.is_available()\ny = undefined_name\n", "Add bad\n\nBad.")
    series.export(repo, repo.tree)
    with pytest.raises(SeriesError) as e:
        series.check(repo)
    msg = str(e.value)
    assert "pkg/bad.py lacks the license header" in msg
    assert "adds `torch.distributed` outside deepspeed/comm/" in msg
    assert "adds `torch.cuda` without `#ignore-cuda`" in msg
    assert "flake8 fails" in msg  # undefined_name (F821)


def test_series_tag_is_a_pep440_local_label(repo):
    add_two_patches(repo)
    tag = series.series_tag(repo)
    assert tag.startswith("series2.g") and len(tag) == len("series2.g") + 10
    from packaging.version import Version
    assert Version(f"1.0+{tag}").local == tag


def test_materialized_tree_installs_with_the_series_label(repo):
    names = add_two_patches(repo)
    series.materialize(repo, repo.tree)
    # What an install of the tree (pip install -e) appends to the version, as the wheel build does.
    assert (repo.tree / "build.txt").read_text() == f"+{series.series_tag(repo)}"
    assert series.build_env(repo)["DS_BUILD_STRING"] == f"+{series.series_tag(repo)}"
    assert sh(repo.tree, "git", "show", "base:build.txt") == "", "the imported sdist stays pristine"
    assert sh(repo.tree, "git", "status", "--porcelain") == ""
    assert series.export(repo, repo.tree) == names
    series.materialize(repo, repo.tree)  # the label is not work that materialize refuses to discard
