"""Tests of tools/series.py on a small stand-in upstream sdist (no network, no DeepSpeed)."""

import hashlib
import io
import json
import os
import re
import shutil
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


# --- status: the series tried on newer releases ---------------------------------------------------------------


def numbered(prefix, n=20):
    return "".join(f"{prefix}{i} = {i}\n" for i in range(n))


def edit(text, **lines):
    """`text` with each line `NAME = ...` given as a keyword replaced by `NAME = VALUE`."""
    for name, value in lines.items():
        text = re.sub(rf"^{name} = .*$", f"{name} = {value}", text, flags=re.M)
    return text


STATUS_FILES = {f"pkg/{m}.py": numbered(m) for m in "abcdefghijkl"}
NEW_MODULE = "# SPDX-License-Identifier: Apache-2.0\n#\n# DeepSpeed Team\n\nNEW = 1\n"

# (subject, {path: text after the patch}) in series order, each a patch on the one before.
STATUS_SERIES = [
    ("Change a", {"pkg/a.py": edit(STATUS_FILES["pkg/a.py"], a5=50)}),
    ("Change b", {"pkg/b.py": edit(STATUS_FILES["pkg/b.py"], b5=50)}),
    ("Change c", {"pkg/c.py": edit(STATUS_FILES["pkg/c.py"], c5=50)}),
    ("Change d and add new", {"pkg/d.py": edit(STATUS_FILES["pkg/d.py"], d5=50), "pkg/new.py": NEW_MODULE}),
    ("Change e and f", {"pkg/e.py": edit(STATUS_FILES["pkg/e.py"], e5=50),
                        "pkg/f.py": edit(STATUS_FILES["pkg/f.py"], f5=50)}),
    ("Change g and h", {"pkg/g.py": edit(STATUS_FILES["pkg/g.py"], g5=50),
                        "pkg/h.py": edit(STATUS_FILES["pkg/h.py"], h5=50)}),
    ("Change c again", {"pkg/c.py": edit(STATUS_FILES["pkg/c.py"], c5=50, c6=60)}),
    ("Change a again", {"pkg/a.py": edit(STATUS_FILES["pkg/a.py"], a5=50, a6=60)}),
    ("Change i", {"pkg/i.py": edit(STATUS_FILES["pkg/i.py"], i5=50)}),
    ("Change j twice", {"pkg/j.py": edit(STATUS_FILES["pkg/j.py"], j1=10, j12=120)}),
    ("Change k", {"pkg/k.py": edit(STATUS_FILES["pkg/k.py"], k5=50)}),
    ("Change l", {"pkg/l.py": edit(STATUS_FILES["pkg/l.py"], l5=50)}),
]

# The release 1.1: what upstream did to each file since 1.0.
RELEASE_FILES = dict(
    STATUS_FILES,
    **{
        "pkg/b.py": "B_NEW = 1\nB_NEW = 2\nB_NEW = 3\n" + STATUS_FILES["pkg/b.py"],  # b5 moves down 3 lines
        "pkg/c.py": edit(STATUS_FILES["pkg/c.py"], c5=55),  # the same line, changed otherwise
        "pkg/d.py": edit(STATUS_FILES["pkg/d.py"], d5=50),  # the patch's change exactly
        "pkg/new.py": NEW_MODULE,  # byte-identical new file
        "pkg/e.py": edit(STATUS_FILES["pkg/e.py"], e5=50),
        "pkg/g.py": edit(STATUS_FILES["pkg/g.py"], g5=50),
        "pkg/h.py": edit(STATUS_FILES["pkg/h.py"], h5=55),
        "pkg/i.py": edit(STATUS_FILES["pkg/i.py"], i3=33),  # inside the hunk's context, two lines from i5
        "pkg/j.py": edit(STATUS_FILES["pkg/j.py"], j1=10),  # one of the patch's two hunks
        "pkg/k.py": edit(STATUS_FILES["pkg/k.py"], k4=44, k5=50),  # the change, and an edit next to it
    })
del RELEASE_FILES["pkg/l.py"]


def pin_release(repo, version, files, notes=None):
    """Put a release sdist of `files` in the cache and pin it in upstream.toml as [against."VERSION"]."""
    sdist = f"pkg-{version}.tar.gz"
    sha = make_sdist(Path(os.environ["DSFORK_CACHE"], sdist), files)
    text = f'\n[against."{version}"]\nsdist = "{sdist}"\nsha256 = "{sha}"\n'
    if notes:
        text += f'\n[against."{version}".notes]\n' + "".join(f'"{k}" = "{v}"\n' for k, v in notes.items())
    with open(repo.root / "upstream.toml", "a") as f:
        f.write(text)
    return sha


def make_fork(root, cache, base_files):
    sha = make_sdist(cache / "pkg-1.0.tar.gz", base_files)
    (root / "patches").mkdir(parents=True)
    (root / "upstream.toml").write_text(f'[upstream]\npackage = "pkg"\nversion = "1.0"\n'
                                        f'sdist = "pkg-1.0.tar.gz"\nsha256 = "{sha}"\n')
    (root / "patches" / "series").write_text("# order of the patches\n")
    sh(root, "git", "init", "-q")
    return series.Repo(root)


def no_download(spec, dest):
    raise AssertionError(f"the test tried to download {spec}")


@pytest.fixture(scope="module")
def status_report(tmp_path_factory):
    """The series STATUS_SERIES on 1.0, tried on the release 1.1 (RELEASE_FILES), all from the cache."""
    tmp = tmp_path_factory.mktemp("status")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSFORK_CACHE", str(tmp / "cache"))
        mp.setattr(series, "pip_download", no_download)
        (tmp / "cache").mkdir()
        repo = make_fork(tmp / "fork", tmp / "cache", STATUS_FILES)
        series.materialize(repo, repo.tree)
        for subject, files in STATUS_SERIES:
            for path, text in files.items():
                Path(repo.tree, path).write_text(text)
            sh(repo.tree, "git", "add", *files)
            sh(repo.tree, "git", "-c", "user.name=Dev", "-c", "user.email=dev@example.com", "commit", "-q", "-m",
               f"{subject}\n\nFor the test.")
        series.export(repo, repo.tree)
        pin_release(repo, "1.1", RELEASE_FILES, notes={"Change c": "1.1 has c5 = 55 | on purpose"})
        pin_release(repo, "1.0.1", STATUS_FILES)  # no change since the base: everything applies
        yield repo, series.status(repo, ["1.1", "1.0.1"])


def results(report, version):
    return {p["subject"]: p["status"][version] for p in report["patches"]}


def states(result):
    return {f["path"]: (f["state"], f["detail"]) for f in result["files"]}


def test_status_verdicts(status_report):
    _, report = status_report
    got = results(report, "1.1")
    assert {s: r["verdict"] for s, r in got.items()} == {
        "Change a": "applies",
        "Change b": "offsets",
        "Change c": "conflicts",
        "Change d and add new": "upstream",
        "Change e and f": "partly-upstream",
        "Change g and h": "conflicts",
        "Change c again": "conflicts",
        "Change a again": "applies",  # only on top of "Change a", which went in
        "Change i": "offsets",
        "Change j twice": "partly-upstream",
        "Change k": "upstream",
        "Change l": "conflicts",
    }
    assert states(got["Change b"]) == {"pkg/b.py": ("offsets", "+3 lines")}
    assert states(got["Change c"]) == {"pkg/c.py": ("conflicts", "")}
    assert states(got["Change d and add new"]) == {"pkg/d.py": ("upstream", ""), "pkg/new.py": ("upstream", "")}
    assert states(got["Change e and f"]) == {"pkg/e.py": ("upstream", ""), "pkg/f.py": ("applies", "")}
    assert states(got["Change g and h"]) == {"pkg/g.py": ("upstream", ""), "pkg/h.py": ("conflicts", "")}
    assert states(got["Change c again"]) == {"pkg/c.py": ("conflicts", "also in patch 3, not applied")}
    assert states(got["Change i"]) == {"pkg/i.py": ("merged", "3-way merge")}
    assert states(got["Change j twice"]) == {"pkg/j.py": ("partly", "in part")}
    assert states(got["Change k"]) == {"pkg/k.py": ("upstream-context", "context differs")}
    assert states(got["Change l"]) == {"pkg/l.py": ("conflicts", "not in the release")}
    assert {r["verdict"] for r in results(report, "1.0.1").values()} == {"applies"}


def test_status_markdown_names_files_and_merges_notes(status_report):
    _, report = status_report
    table = series.status_markdown(report, "python3 tools/series.py status --against 1.1 1.0.1")
    rows = {line.split(" | ")[1].strip("`"): line.split(" | ")[2] for line in table.splitlines()[2:] if " | " in line}
    assert table.splitlines()[0] == "| # | patch | 1.1 | 1.0.1 |"
    assert rows["Change a"] == "applies"
    assert rows["Change b"] == "applies with offsets: `pkg/b.py` (+3 lines)"
    assert rows["Change c"] == r"conflicts: `pkg/c.py`. *1.1 has c5 = 55 \| on purpose*"
    assert rows["Change d and add new"] == "already upstream"
    assert rows["Change e and f"] == "partly upstream: `pkg/e.py`. The rest applies"
    assert rows["Change g and h"] == "conflicts: `pkg/h.py`. Already upstream: `pkg/g.py`"
    assert rows["Change c again"] == "conflicts: `pkg/c.py` (also in patch 3, not applied)"
    assert rows["Change j twice"] == "partly upstream: `pkg/j.py` (in part). The rest applies"
    assert rows["Change k"] == "already upstream: `pkg/k.py` (context differs)"
    assert rows["Change l"] == "conflicts: `pkg/l.py` (not in the release)"
    assert "`python3 tools/series.py status --against 1.1 1.0.1`" in table


def test_status_cli_prints_table_or_json_and_warns_about_notes_for_no_patch(repo, capsys, monkeypatch):
    monkeypatch.setattr(series, "pip_download", no_download)
    add_two_patches(repo)
    pin_release(repo, "1.1", UPSTREAM_FILES, notes={"Add OTHER": "fine", "Renamed away": "stale"})
    assert series.main(["--root", str(repo.root), "status", "--against", "1.1", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [p["status"]["1.1"]["verdict"] for p in report["patches"]] == ["applies", "applies"]
    assert report["patches"][0]["status"]["1.1"]["note"] == "fine"
    assert report["unmatched_notes"] == {"1.1": {"Renamed away": "stale"}}
    assert '[against."1.1".notes] names "Renamed away"' in err
    assert series.main(["--root", str(repo.root), "status", "--against", "1.1"]) == 0
    table = series.status_markdown(report, "python3 tools/series.py status --against 1.1")
    assert capsys.readouterr().out == table + "\n"


def test_status_fetches_a_release_like_the_base_and_verifies_it(repo, monkeypatch):
    add_two_patches(repo)
    cache = Path(os.environ["DSFORK_CACHE"])
    sha = pin_release(repo, "1.1", UPSTREAM_FILES)
    (cache / "pkg-1.1.tar.gz").rename(repo.root.parent / "index-pkg-1.1.tar.gz")
    asked = []

    def fake_index(spec, dest):  # stands in for `pip download`, serving the release's file
        asked.append(spec)
        shutil.copy(repo.root.parent / "index-pkg-1.1.tar.gz", Path(dest, "pkg-1.1.tar.gz"))

    monkeypatch.setattr(series, "pip_download", fake_index)
    assert series.status(repo, ["1.1"])["releases"] == [{"version": "1.1", "sdist": "pkg-1.1.tar.gz", "sha256": sha}]
    assert asked == ["pkg==1.1"] and (cache / "pkg-1.1.tar.gz").exists()

    make_sdist(cache / "pkg-1.1.tar.gz", {"pkg/__init__.py": "tampered\n"})
    with pytest.raises(SeriesError, match=f"pkg-1.1.tar.gz: sha256 is [0-9a-f]+, but upstream.toml pins {sha}"):
        series.status(repo, ["1.1"])
    with pytest.raises(SeriesError, match=r'has no \[against."2.0"\]; add its sdist name and the sha256'):
        series.status(repo, ["2.0"])
    assert repo.upstream().version == "1.0", "a release to compare with never becomes the base"


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


def test_status_without_a_newer_release_says_so(repo, capsys, monkeypatch):
    add_two_patches(repo)
    monkeypatch.setattr(series, "pip_download", no_download)
    assert series.main(["--root", str(repo.root), "status"]) == 0
    out = capsys.readouterr().out
    assert "No release newer than the base 1.0 is pinned in upstream.toml" in out
    assert 'pin it as [against."VERSION"]' in out


def test_status_defaults_to_every_pinned_release_newest_last(repo, capsys, monkeypatch):
    add_two_patches(repo)
    monkeypatch.setattr(series, "pip_download", no_download)
    pin_release(repo, "1.10", UPSTREAM_FILES)
    pin_release(repo, "1.9", UPSTREAM_FILES)
    assert repo.pinned_releases() == ["1.9", "1.10"]
    assert series.main(["--root", str(repo.root), "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in report["releases"]] == ["1.9", "1.10"]


def test_status_refuses_a_release_that_is_not_newer_than_the_base(repo):
    add_two_patches(repo)
    pin_release(repo, "0.9", UPSTREAM_FILES)
    pin_release(repo, "1.0", UPSTREAM_FILES)
    for version in ("0.9", "1.0"):
        with pytest.raises(SeriesError, match=rf'\[against."{version}"\] is not newer than the base 1.0'):
            series.status(repo, [version])
    with pytest.raises(SeriesError, match="not a release version"):
        series.version_key("1.0rc1")
