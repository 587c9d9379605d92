#!/usr/bin/env python3
"""Keep this fork as a patch series on the pinned DeepSpeed sdist.

Verbs (``python tools/series.py VERB --help``):
  fetch        download the pinned sdist into the cache and verify its sha256
  materialize  build build/deepspeed: base commit (pristine sdist) + one commit per patch
  export       write the commits base..HEAD of build/deepspeed back to patches/
  check        fresh materialization, byte round trip, message and upstream-rule checks, yapf, flake8
  build        wheel and sdist of the patched tree, versioned <base version>+<series tag>
  tag          print the series tag
  status       how each patch fares on newer upstream releases ([--against VERSION ...]), as a table

Standard library plus the ``git`` binary: patches are applied with ``git am`` and written with
``git format-patch``; nothing here parses or produces diffs itself.
"""

import argparse
import filecmp
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every git call runs without the user's or the system's configuration, so that what git writes
# (patch text, commit ids) depends on the inputs alone.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "LC_ALL": "C",
    "TZ": "UTC",
    # The base commit and every commit `git am` makes get this committer and date, so a
    # materialization repeats its commit ids. Authors and author dates come from the patches.
    "GIT_COMMITTER_NAME": "DeepSpeed fork series",
    "GIT_COMMITTER_EMAIL": "series@deepspeed-fork.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_AUTHOR_NAME": "DeepSpeed fork series",
    "GIT_AUTHOR_EMAIL": "series@deepspeed-fork.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
}

# The only place that says how a patch file is written. Each option removes one source of noise,
# so that exporting an unchanged tree rewrites no byte.
FORMAT_PATCH_OPTIONS = [
    "--zero-commit",  # the "From <sha>" line would change whenever a commit is re-created
    "--no-signature",  # the "-- <git version>" trailer differs between git installations
    "--full-index",  # abbreviated blob ids grow with the object count and differ between clones
    "--no-renames",  # rename detection depends on configuration and similarity heuristics
    "--no-stat",  # diffstat layout and width vary between git versions
    "--no-numbered",  # "[PATCH n/m]" would rewrite every subject when a patch is added
    "--no-color",
    "--encoding=UTF-8",
    "--filename-max-length=64",  # pin the file-name length that newer gits default to
]

# Paths that upstream's setup.py rewrites when it builds or installs from a tree; changes to them
# are build output, not work (the sdist tracks them, so .gitignore cannot hide them).
GENERATED_PATHS = ("build.txt", "deepspeed/git_version_info_installed.py", "deepspeed.egg-info")
ARTEFACT_RE = re.compile(r"(^|/)(__pycache__/|build/|dist/|[^/]*\.egg-info/)|\.(pyc|so)$")

LICENSE_HEADER = ("# SPDX-License-Identifier: Apache-2.0", "#", "# DeepSpeed Team")
# The header upstream gives files holding code derived from TorchTitan (deepspeed/moe/ep_*.py, auto_ep_layer.py): a
# new file that such code moves into keeps it, BSD notice included.
TORCHTITAN_LICENSE_HEADER = ("# Copyright (c) DeepSpeed Team.", "# Copyright (c) Meta Platforms, Inc. and affiliates.",
                             "# All rights reserved.", "# SPDX-License-Identifier: Apache-2.0 AND BSD-3-Clause", "#",
                             "# Portions of this file are derived from TorchTitan.",
                             "# See THIRD_PARTY_NOTICES.md for the BSD-3-Clause notice.", "", "# DeepSpeed Team")
LICENSED_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".sh")
C_LICENSE_HEADER = ("// Copyright (c) Microsoft Corporation.", "// SPDX-License-Identifier: Apache-2.0",
                    "", "// DeepSpeed Team")

# Upstream's style configuration (.style.yapf and .flake8 are not shipped in the sdist).
YAPF_STYLE = "{based_on_style: pep8, column_limit: 119, split_all_comma_separated_values: false}"
FLAKE8_ARGS = ["--ignore=E,F403,F405,F541,F841,W", "--select=E9,F,W6", "--per-file-ignores=__init__.py:F401"]

MARKER = "series-exported"  # in .git/: the HEAD that patches/ is known to hold


class SeriesError(Exception):
    """A problem the user must fix; the message says what and how."""


@dataclass(frozen=True)
class Upstream:
    package: str
    version: str
    sdist: str
    sha256: str
    notes: tuple = ()  # (patch subject, words) pairs, for a release that `status` compares with


@dataclass(frozen=True)
class Repo:
    root: Path

    @property
    def patches(self):
        return self.root / "patches"

    @property
    def series_file(self):
        return self.patches / "series"

    @property
    def tree(self):
        return self.root / "build" / "deepspeed"

    def upstream(self):
        path = self.root / "upstream.toml"
        try:
            data = tomllib.loads(path.read_text())["upstream"]
            return Upstream(**{k: str(data[k]) for k in ("package", "version", "sdist", "sha256")})
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as e:
            raise SeriesError(f"{path}: cannot read [upstream] package, version, sdist and sha256: {e}")

    def pinned_releases(self):
        """The versions pinned as [against."VERSION"] in upstream.toml, oldest first."""
        path = self.root / "upstream.toml"
        return sorted(tomllib.loads(path.read_text()).get("against", {}), key=version_key)

    def release(self, version):
        """A newer release that `status` compares the series with: [against."VERSION"] in upstream.toml."""
        path = self.root / "upstream.toml"
        base = self.upstream()
        entry = tomllib.loads(path.read_text()).get("against", {}).get(version)
        if entry is None:
            raise SeriesError(f'{path} has no [against."{version}"]; add its sdist name and the sha256 that the '
                              f"package index lists for it (https://pypi.org/simple/{base.package}/)")
        if version_key(version) <= version_key(base.version):
            raise SeriesError(f'{path}: [against."{version}"] is not newer than the base {base.version}; '
                              f"`status` compares the series with later releases only: remove the entry")
        try:
            notes = entry.get("notes", {})
            return Upstream(base.package, version, str(entry["sdist"]), str(entry["sha256"]),
                            tuple((str(k), str(v)) for k, v in notes.items()))
        except (KeyError, TypeError, AttributeError) as e:
            raise SeriesError(f'{path}: [against."{version}"] needs sdist and sha256 (and notes a table): {e}')


def version_key(version):
    """A release version as a sortable tuple: "0.19.10" after "0.19.8" (final releases, as DeepSpeed tags them)."""
    parts = version.split(".")
    if not all(part.isdigit() for part in parts):
        raise SeriesError(f"{version!r} is not a release version of digits and dots (such as 0.19.8)")
    return tuple(int(part) for part in parts)


def log(msg):
    print(f"series: {msg}", file=sys.stderr)


def git(cwd, *args, check=True):
    """Run git in `cwd` with the pinned environment; return its stdout."""
    env = dict(os.environ, **GIT_ENV)
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr.strip()}")
    return proc.stdout if check else proc


# --- upstream sdist -------------------------------------------------------------------------------


def cache_dir():
    if os.environ.get("DSFORK_CACHE"):
        return Path(os.environ["DSFORK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepspeed-fork"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path, upstream):
    actual = sha256_of(path)
    if actual != upstream.sha256:
        raise SeriesError(f"{path}: sha256 is {actual}, but upstream.toml pins {upstream.sha256}. "
                          f"Delete the file to download it again, or correct upstream.toml.")


def pip_download(spec, dest):
    """`pip download` the sdist of `spec` into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest), spec]
    # pip prepares the sdist's metadata even for a download. Without build isolation that needs `wheel` next to
    # setuptools in this interpreter (a bare system Python lacks it: "invalid command 'bdist_wheel'"); with
    # isolation pip fetches both from the index. Try the interpreter's own tools first.
    proc = subprocess.run(cmd[:-3] + ["--no-build-isolation"] + cmd[-3:], capture_output=True, text=True)
    if proc.returncode != 0:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"could not download {spec} with pip:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def fetch_sdist(repo, upstream=None):
    """Return the verified sdist of `upstream` (default: the base) from the cache, downloading it with pip
    if it is not there."""
    upstream = upstream or repo.upstream()
    cached = cache_dir() / upstream.sdist
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        spec = f"{upstream.package}=={upstream.version}"
        log(f"downloading the {spec} sdist into {cached.parent}")
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            pip_download(spec, tmp)
            got = Path(tmp) / upstream.sdist
            if not got.exists():
                raise SeriesError(f"pip downloaded {[p.name for p in Path(tmp).iterdir()]} for {spec}, "
                                  f"not {upstream.sdist}; correct the sdist name in upstream.toml")
            verify(got, upstream)
            os.replace(got, cached)
    verify(cached, upstream)
    return cached


def extract_sdist(sdist, dest):
    """Unpack the sdist's single top-level directory as `dest`."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        tops = list(Path(tmp).iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            raise SeriesError(f"{sdist}: expected one top-level directory, found {[p.name for p in tops]}")
        os.replace(tops[0], dest)


# --- the series file ------------------------------------------------------------------------------


def read_series(repo):
    """Patch names in order; `series` and the .patch files must name exactly the same set."""
    if not repo.series_file.exists():
        raise SeriesError(f"{repo.series_file} is missing; create it (it may be empty)")
    names = []
    for lineno, line in enumerate(repo.series_file.read_text().splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if name in names:
            raise SeriesError(f"{repo.series_file}:{lineno}: {name} is listed twice")
        names.append(name)
    missing = [n for n in names if not (repo.patches / n).is_file()]
    unlisted = sorted(p.name for p in repo.patches.glob("*.patch") if p.name not in names)
    problems = [f"series lists {n}, but patches/{n} does not exist" for n in missing]
    problems += [f"patches/{n} is not listed in patches/series: add it there, or delete the file" for n in unlisted]
    if problems:
        raise SeriesError("; ".join(problems))
    return names


def write_series(repo, names):
    header = []
    if repo.series_file.exists():
        for line in repo.series_file.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
    if not header:
        header = ["# Applied in this order onto the pinned sdist by tools/series.py; one patch file per line."]
    repo.series_file.write_text("\n".join(header + names) + "\n")


# --- materialized tree ----------------------------------------------------------------------------


def uncommitted(tree):
    """Porcelain lines for edits in `tree` that are work rather than build output."""
    lines = git(tree, "status", "--porcelain", "--untracked-files=all").splitlines()
    return [line for line in lines if not ARTEFACT_RE.search(line[3:])]


def has_unexported_commits(repo, tree):
    head = git(tree, "rev-parse", "HEAD").strip()
    marker = Path(git(tree, "rev-parse", "--git-dir").strip(), MARKER)
    if not marker.is_absolute():
        marker = tree / marker
    if marker.exists() and marker.read_text().strip() == head:
        return False
    # Not recorded (e.g. the tree predates the marker): compare what it would export with patches/.
    with tempfile.TemporaryDirectory() as tmp:
        names = export_commits(tree, Path(tmp))
        try:
            current = read_series(repo)
        except SeriesError:
            return True
        return names != current or any(not filecmp.cmp(Path(tmp, n), repo.patches / n, shallow=False) for n in names)


def record_exported(tree):
    git_dir = Path(git(tree, "rev-parse", "--absolute-git-dir").strip())
    (git_dir / MARKER).write_text(git(tree, "rev-parse", "HEAD"))


def refuse_to_destroy(repo, tree):
    if not tree.exists():
        return
    if not (tree / ".git").exists():
        raise SeriesError(f"{tree} exists but is not a materialized tree; move it away, or pass --force")
    if git(tree, "rev-parse", "-q", "--verify", "refs/tags/base", check=False).returncode != 0:
        raise SeriesError(f"{tree} has no 'base' tag, so it is not a materialized tree; move it away, or pass --force")
    dirty = uncommitted(tree)
    if dirty:
        shown = "\n  ".join(dirty[:20])
        raise SeriesError(f"{tree} has uncommitted changes; commit them (with -s) and run "
                          f"`tools/series.py export`, or pass --force to discard them:\n  {shown}")
    if has_unexported_commits(repo, tree):
        raise SeriesError(f"{tree} has commits that are not exported to patches/; run `tools/series.py export` "
                          f"and commit patches/, or pass --force to discard them")


def materialize(repo, tree, force=False):
    """Build `tree`: the pristine sdist as commit `base`, then `git am` of each patch in series order."""
    names = read_series(repo)
    sdist = fetch_sdist(repo)
    if not force:
        refuse_to_destroy(repo, tree)
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    extract_sdist(sdist, tree)
    upstream = repo.upstream()
    git(tree, "init", "-q", "-b", "main")
    # Build output of upstream's setup.py; tracked files are unaffected by the exclude file.
    Path(tree, ".git", "info", "exclude").write_text("/build/\n/build.txt\n/dist/\n__pycache__/\n*.pyc\n*.so\n"
                                                     ".pytest_cache/\n")
    git(tree, "add", "-A", "-f")
    git(tree, "commit", "-q", "--no-verify", "-m",
        f"Import {upstream.package} {upstream.version} (PyPI sdist)\n\nsha256 {upstream.sha256}")
    git(tree, "tag", "base")
    for name in names:
        proc = git(tree, "am", "--quiet", "--no-3way", str(repo.patches / name), check=False)
        if proc.returncode != 0:
            detail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                               if line.startswith(("error:", "fatal:")))
            git(tree, "am", "--abort", check=False)
            record_exported(tree)
            raise SeriesError(f"patches/{name} does not apply to base and the patches before it:\n{detail}\n"
                              f"{tree} now holds the patches before it. Rebase the patch there (for example "
                              f"`git -C {tree} am -3 {repo.patches / name}`, resolve, `git am --continue`), "
                              f"then apply the rest and run `tools/series.py export`.")
    # setup.py rewrites these on every build and install; keep `git commit -a` from picking them up.
    generated = git(tree, "ls-files", "--", *GENERATED_PATHS).split()
    if generated:
        git(tree, "update-index", "--skip-worktree", *generated)
    # setup.py appends build.txt to the version when DS_BUILD_STRING is unset, as in `pip install -e` of this
    # tree: give it the label that build_env() gives the wheel, so that both install the same version.
    (tree / "build.txt").write_text(build_string(repo))
    record_exported(tree)
    log(f"materialized {tree}: base + {len(names)} patch(es)")
    return names


# --- export ---------------------------------------------------------------------------------------


def export_commits(tree, outdir):
    """`git format-patch base..HEAD` into `outdir`; returns the file names in order."""
    out = git(tree, "format-patch", *FORMAT_PATCH_OPTIONS, "-o", str(outdir), "base..HEAD")
    return [Path(line).name for line in out.splitlines() if line.strip()]


def export(repo, tree):
    if not (tree / ".git").exists():
        raise SeriesError(f"{tree} does not exist; run `tools/series.py materialize` first")
    dirty = uncommitted(tree)
    if dirty:
        raise SeriesError(f"{tree} has uncommitted changes; commit them (git commit -s) before exporting:\n  " +
                          "\n  ".join(dirty[:20]))
    with tempfile.TemporaryDirectory() as tmp:
        names = export_commits(tree, Path(tmp))
        changed = []
        for name in names:
            dst = repo.patches / name
            if not dst.exists() or not filecmp.cmp(Path(tmp, name), dst, shallow=False):
                changed.append(name)
                shutil.copyfile(Path(tmp, name), dst)
    removed = sorted(p.name for p in repo.patches.glob("*.patch") if p.name not in names)
    for name in removed:
        (repo.patches / name).unlink()
    write_series(repo, names)
    record_exported(tree)
    log(f"exported {len(names)} patch(es): {len(changed)} written, {len(removed)} removed")
    return names


# --- check ----------------------------------------------------------------------------------------


def patch_message(text):
    """(subject, body) of a format-patch file."""
    head = re.split(r"^(?:---|diff --git .*)$", text, maxsplit=1, flags=re.M)[0]
    headers, _, body = head.partition("\n\n")
    subject = re.search(r"^Subject: (?:\[PATCH\] )?(.*(?:\n .*)*)", headers, re.M)
    return (subject.group(1).replace("\n ", " ") if subject else ""), body


def added_lines(text):
    """(path, line) for each added line of a format-patch file."""
    path = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("+") and path:
            yield path, line[1:]


def check_messages(repo, names):
    problems = []
    for name in names:
        text = (repo.patches / name).read_text()
        subject, body = patch_message(text)
        prose = [line for line in body.splitlines() if line.strip() and not re.match(r"^[\w-]+: ", line)]
        if not subject:
            problems.append(f"patches/{name}: no subject")
        if not prose:
            problems.append(f"patches/{name}: the message has no body (say why, what changes for users, how tested)")
        if not re.search(r"^Signed-off-by: .+ <.+>$", body, re.M):
            problems.append(f"patches/{name}: no Signed-off-by trailer (commit with `git commit -s`)")
    return problems


def check_upstream_rules(repo, names, tree):
    problems = []
    for name in names:
        text = (repo.patches / name).read_text()
        for path in re.findall(r"^diff --git a/\S+ b/(\S+)\nnew file mode", text, re.M):
            if path.endswith(LICENSED_SUFFIXES):
                first = Path(tree, path).read_text().splitlines()
                header = C_LICENSE_HEADER if path.endswith((".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")) \
                    else LICENSE_HEADER
                if path.endswith(".sh") and first[:1] and first[0].startswith("#!"):
                    first = first[1:]
                if header is LICENSE_HEADER and tuple(first[:len(TORCHTITAN_LICENSE_HEADER)]) == TORCHTITAN_LICENSE_HEADER:
                    continue
                if tuple(first[:len(header)]) != header:
                    problems.append(f"patches/{name}: new file {path} lacks the license header {header}")
        for path, line in added_lines(text):
            if "torch.distributed" in line and not path.startswith("deepspeed/comm/"):
                problems.append(f"patches/{name}: {path} adds `torch.distributed` outside deepspeed/comm/ "
                                f"(use `import deepspeed.comm as dist`): {line.strip()}")
            if "torch.cuda" in line and "#ignore-cuda" not in line and path != "accelerator/cuda_accelerator.py":
                problems.append(f"patches/{name}: {path} adds `torch.cuda` without `#ignore-cuda` "
                                f"(use get_accelerator()): {line.strip()}")
    return problems


def touched_python_files(tree):
    out = git(tree, "diff", "--name-only", "--diff-filter=d", "base..HEAD", "--", "*.py")
    return [p for p in out.splitlines() if p]


def check_style(tree):
    files = touched_python_files(tree)
    if not files:
        return []
    problems = []
    for tool, cmd in (("yapf", ["-m", "yapf", "--diff", f"--style={YAPF_STYLE}", *files]),
                      ("flake8", ["-m", "flake8", *FLAKE8_ARGS, *files])):
        proc = subprocess.run([sys.executable, *cmd], cwd=tree, capture_output=True, text=True)
        if "No module named" in proc.stderr:
            raise SeriesError(f"{tool} is not installed; `pip install yapf==0.40.0 flake8==5.0.4`")
        if proc.returncode != 0:
            problems.append(f"{tool} fails on the series' files (fix in build/deepspeed, commit, export):\n"
                            f"{(proc.stdout + proc.stderr)[-6000:]}")
    return problems


def check(repo):
    names = read_series(repo)
    problems = check_messages(repo, names)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp, "deepspeed")
        materialize(repo, tree, force=True)
        exported = Path(tmp, "exported")
        exported.mkdir()
        again = export_commits(tree, exported)
        if again != names:
            problems.append(f"re-export names the patches {again}, but patches/series lists {names}; "
                            f"run `tools/series.py materialize && tools/series.py export`")
        for name in set(again) & set(names):
            if not filecmp.cmp(exported / name, repo.patches / name, shallow=False):
                problems.append(f"patches/{name} is not in canonical form (re-export changes it); "
                                f"run `tools/series.py materialize --force && tools/series.py export`")
        problems += check_upstream_rules(repo, names, tree)
        problems += check_style(tree)
    if problems:
        raise SeriesError(f"check found {len(problems)} problem(s):\n- " + "\n- ".join(problems))
    log(f"check passed: {len(names)} patch(es) apply cleanly, re-export is byte-identical, rules and style hold")


# --- build ----------------------------------------------------------------------------------------


def series_tag(repo):
    """PEP 440 local version label naming the series: patch count and a digest of the patches."""
    names = read_series(repo)
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0" + (repo.patches / name).read_bytes())
    # "g" keeps an all-digit digest from being normalized as a number.
    return f"series{len(names)}.g{digest.hexdigest()[:10]}"


def build_string(repo):
    """What upstream's setup.py appends to version.txt: `+` and the series tag."""
    return f"+{series_tag(repo)}"


def build_env(repo):
    env = dict(os.environ)
    env["DS_BUILD_OPS"] = "0"  # upstream's default: ops are JIT-compiled on first use
    env["DS_BUILD_STRING"] = build_string(repo)
    return env


def run_setuptools(repo, tree, hook, outdir):
    """Call upstream's (legacy setuptools) build backend hook inside `tree`; return the file name."""
    code = ("import sys; from setuptools.build_meta import __legacy__ as backend; "
            f"print('\\nBUILT:' + backend.{hook}(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(outdir)], cwd=tree, env=build_env(repo),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"upstream {hook} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout.rsplit("BUILT:", 1)[1].strip()


def build(repo, outdir, kinds=("sdist", "wheel")):
    outdir = Path(outdir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp, "deepspeed")
        materialize(repo, tree, force=True)
        for kind in kinds:
            built.append(run_setuptools(repo, tree, f"build_{kind}", outdir))
    for name in built:
        log(f"built {outdir / name}")
    return built


# --- status against newer releases ----------------------------------------------------------------

# What `status` finds for one file of a patch, tried on a newer release plus the patches before it that
# went in. The reverse is tried first, so a change the release already holds is never counted as one
# that applies somewhere else.
UPSTREAM = "upstream"  # the reverse applies (a new file: the release has it byte for byte), or a 3-way merge is a no-op
CONTEXT = "upstream-context"  # conflicts, but the release has every line the patch adds and lacks one it removes
PARTLY = "partly"  # a 3-way merge is clean but changes fewer lines than the patch: part of it is already there
APPLIES = "applies"  # every hunk applies at its recorded line
OFFSETS = "offsets"  # every hunk matches its context, some at other lines (git apply -v: "offset N lines")
MERGED = "merged"  # the context changed, and git's 3-way merge makes the whole change without conflict
CONFLICTS = "conflicts"  # neither applies nor merges
IN_RELEASE = (UPSTREAM, CONTEXT, PARTLY)

# The verdict on a patch, from the states of its files, first match wins. A patch with a conflicting file
# conflicts, whatever its other files do (the table and the JSON still name those already upstream); one
# that is partly in the release (some files, or some hunks of a file) with no conflict is "partly
# upstream", never "applies"; "already upstream" needs every file in the release.
VERDICTS = {
    "conflicts": "conflicts",
    "upstream": "already upstream",
    "partly-upstream": "partly upstream",
    "offsets": "applies with offsets",
    "applies": "applies",
}


def verdict_of(states):
    if CONFLICTS in states:
        return "conflicts"
    if states and set(states) <= {UPSTREAM, CONTEXT}:
        return "upstream"
    if set(states) & set(IN_RELEASE):
        return "partly-upstream"
    if set(states) & {OFFSETS, MERGED}:
        return "offsets"
    return "applies"


def include_option(path):
    """`git apply` option selecting exactly `path` (its pattern is a wildmatch glob)."""
    return "--include=" + re.sub(r"([*?[\\])", r"\\\1", path)


def patch_files(tree, patch):
    """(path, added, deleted) for each file of `patch`, in its order, as git counts them ("-" if binary)."""
    rows = []
    for line in git(tree, "apply", "--numstat", str(patch)).splitlines():
        added, deleted, path = line.split("\t", 2)
        rows.append((path, added, deleted))
    return rows


def try_file(tree, patch, path, added, deleted):
    """(state, detail) of one file of `patch` on the clean tree `tree`, which is left unchanged."""

    def applies(*options):
        return git(tree, "apply", "--check", *options, include_option(path), str(patch), check=False)

    if applies("-R").returncode == 0:
        return UPSTREAM, ""
    proc = applies("-v")
    if proc.returncode == 0:
        moved = re.findall(r"^Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)", proc.stderr, re.M)
        offsets = [int(n) for n in moved]
        if not offsets:
            return APPLIES, ""
        low, high = min(offsets), max(offsets)
        return OFFSETS, f"{low:+d} lines" if low == high else f"{low:+d} to {high:+d} lines"
    present = (tree / path).exists()
    try:
        if git(tree, "apply", "--3way", include_option(path), str(patch), check=False).returncode == 0:
            stat = git(tree, "diff", "--cached", "--numstat", "HEAD", "--", path).split("\t")
        else:
            stat = None
    finally:
        git(tree, "reset", "-q", "--hard")
        git(tree, "clean", "-fdq")
    if stat is None:
        if not present:
            return CONFLICTS, "not in the release"
        # Without context, the reverse needs every added line in the release and the forward every removed
        # one. Only the first holding means the change is there and only its surroundings differ (a 3-way
        # merge stops at an upstream edit next to the patch's, such as a changed neighbouring import).
        if applies("-R", "-C0").returncode == 0 and applies("-C0").returncode != 0:
            return CONTEXT, "context differs"
        return CONFLICTS, ""
    if len(stat) < 3:
        return UPSTREAM, ""
    if added.isdigit() and deleted.isdigit() and (int(stat[0]) < int(added) or int(stat[1]) < int(deleted)):
        return PARTLY, "in part"
    return MERGED, "3-way merge"


def try_patch(tree, patch):
    """Classify every file of `patch` on `tree`; unless one conflicts, commit what the release lacks."""
    files = []
    for path, added, deleted in patch_files(tree, patch):
        state, detail = try_file(tree, patch, path, added, deleted)
        files.append({"path": path, "state": state, "detail": detail})
    if any(f["state"] == CONFLICTS for f in files):
        return files, False  # like `git am`: all or nothing
    plain = [include_option(f["path"]) for f in files if f["state"] in (APPLIES, OFFSETS)]
    if plain:
        git(tree, "apply", "--index", *plain, str(patch))
    for f in files:
        if f["state"] in (MERGED, PARTLY):
            git(tree, "apply", "--3way", include_option(f["path"]), str(patch))
    if git(tree, "status", "--porcelain"):
        git(tree, "commit", "-q", "--no-verify", "-m", patch.name)
    return files, True


def release_tree(repo, release, dest, objects):
    """`dest`: a git repository of the release's sdist that can also read the blobs in `objects` (the
    materialized series), which `git apply --3way` needs as the patches' preimages."""
    extract_sdist(fetch_sdist(repo, release), dest)
    git(dest, "init", "-q", "-b", "main")
    Path(dest, ".git", "objects", "info", "alternates").write_text(f"{objects}\n")
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "--no-verify", "-m", f"Import {release.package} {release.version} (PyPI sdist)")


def status(repo, versions):
    """How every patch, in series order, fares on each release in `versions`; see VERDICTS."""
    base = repo.upstream()
    releases = [repo.release(v) for v in versions]
    names = read_series(repo)
    subjects = [patch_message((repo.patches / n).read_text())[0] for n in names]
    report = {
        "base": base.version,
        "releases": [{"version": r.version, "sdist": r.sdist, "sha256": r.sha256} for r in releases],
        "patches": [{"number": i, "name": n, "subject": s, "status": {}}
                    for i, (n, s) in enumerate(zip(names, subjects), 1)],
        "unmatched_notes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        series_tree = Path(tmp, "series")
        materialize(repo, series_tree, force=True)
        objects = Path(git(series_tree, "rev-parse", "--absolute-git-dir").strip(), "objects")
        for release in releases:
            tree = Path(tmp, f"release-{release.version}")
            release_tree(repo, release, tree, objects)
            notes = dict(release.notes)
            skipped = {}  # path -> number of the first conflicting (so not applied) patch touching it
            for entry in report["patches"]:
                files, applied = try_patch(tree, repo.patches / entry["name"])
                for f in files:
                    if f["state"] == CONFLICTS and f["path"] in skipped:
                        f["detail"] = f"also in patch {skipped[f['path']]}, not applied"
                    if not applied:
                        skipped.setdefault(f["path"], entry["number"])
                entry["status"][release.version] = {
                    "verdict": verdict_of([f["state"] for f in files]),
                    "files": files,
                    "note": notes.pop(entry["subject"], None),
                }
            for subject in notes:
                log(f'upstream.toml [against."{release.version}".notes] names "{subject}", which is the subject of '
                    f"no patch in patches/series: correct the subject or remove the note")
            report["unmatched_notes"][release.version] = notes
            counts = {}
            for entry in report["patches"]:
                verdict = entry["status"][release.version]["verdict"]
                counts[verdict] = counts.get(verdict, 0) + 1
            log(f"{release.version}: " + ", ".join(f"{VERDICTS[v]} {counts[v]}" for v in VERDICTS if v in counts))
    return report


def status_cell(result):
    """The Markdown text of one patch on one release."""

    def paths(states):
        groups = {}  # detail -> paths with that detail, in patch order
        for f in result["files"]:
            if f["state"] in states:
                groups.setdefault(f["detail"], []).append(f"`{f['path']}`")
        return "; ".join(", ".join(group) + (f" ({detail})" if detail else "") for detail, group in groups.items())

    verdict = result["verdict"]
    text = VERDICTS[verdict]
    if verdict == "offsets":
        text += ": " + paths((OFFSETS, MERGED))
    elif verdict == "conflicts":
        text += ": " + paths((CONFLICTS, ))
        if any(f["state"] in IN_RELEASE for f in result["files"]):
            text += ". Already upstream: " + paths(IN_RELEASE)
    elif verdict == "upstream" and any(f["state"] == CONTEXT for f in result["files"]):
        text += ": " + paths(IN_RELEASE)
    elif verdict == "partly-upstream":
        text += ": " + paths(IN_RELEASE)
        rest = paths((OFFSETS, MERGED))
        text += f". The rest applies with offsets: {rest}" if rest else ". The rest applies"
    if result["note"]:
        text += f". *{result['note']}*"
    return text.replace("|", "\\|")


def status_markdown(report, command):
    versions = [r["version"] for r in report["releases"]]
    lines = ["| # | patch | " + " | ".join(versions) + " |", "|---:|---|" + "---|" * len(versions)]
    for entry in report["patches"]:
        cells = [status_cell(entry["status"][v]) for v in versions]
        subject = entry["subject"].replace("|", "\\|")
        lines.append(f"| {entry['number']} | `{subject}` | " + " | ".join(cells) + " |")
    lines += ["", f"Each patch of the series on {report['base']}, tried in order on each release on top of the ones "
              f"before it that went in; generated by `{command}`. Words in italics are notes from `upstream.toml` "
              f"(`[against.\"VERSION\".notes]`, keyed by patch subject)."]
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/series.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("fetch", help="download and verify the pinned sdist")
    p = verbs.add_parser("materialize", help="build build/deepspeed from the sdist and patches/")
    p.add_argument("--force", action="store_true", help="discard uncommitted or unexported work in the tree")
    verbs.add_parser("export", help="write base..HEAD of build/deepspeed to patches/")
    verbs.add_parser("check", help="verify the series on a fresh materialization")
    p = verbs.add_parser("build", help="build a wheel and an sdist of the patched tree")
    p.add_argument("--outdir", default=ROOT / "dist")
    verbs.add_parser("tag", help="print the series tag (the local version label)")
    p = verbs.add_parser("status", help="try every patch on newer upstream releases and print a table")
    p.add_argument("--against", nargs="+", metavar="VERSION",
                   help='releases pinned in upstream.toml as [against."VERSION"] (default: every pinned one)')
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    args = parser.parse_args(argv)
    repo = Repo(args.root.resolve())
    try:
        if args.verb == "fetch":
            print(fetch_sdist(repo))
        elif args.verb == "materialize":
            materialize(repo, repo.tree, force=args.force)
        elif args.verb == "export":
            export(repo, repo.tree)
        elif args.verb == "check":
            check(repo)
        elif args.verb == "build":
            build(repo, args.outdir)
        elif args.verb == "tag":
            print(series_tag(repo))
        elif args.verb == "status":
            versions = args.against or repo.pinned_releases()
            if not versions:
                # Not an error: the base is the newest release until upstream publishes another.
                print(f"No release newer than the base {repo.upstream().version} is pinned in upstream.toml. When "
                      f'upstream publishes one, pin it as [against."VERSION"] (sdist name and the sha256 that '
                      f"https://pypi.org/simple/{repo.upstream().package}/ lists) and run this again.")
                return 0
            report = status(repo, versions)
            command = "python3 tools/series.py status --against " + " ".join(versions)
            print(json.dumps(report, indent=2) if args.json else status_markdown(report, command))
    except SeriesError as e:
        print(f"series: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
