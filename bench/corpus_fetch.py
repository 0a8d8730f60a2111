"""The doctor's corpus of public code: a pinned manifest here, the files in a cache.

The repository keeps facts about each public file the doctor is measured on, never the
file: tests/doctor_corpus/manifest.json gives, per file, its repository, the commit (or
the release) it was read at, its path there, its git blob SHA-1, its line count and the
SPDX id of its licence, and `file`, where it goes in the cache. The cache lies outside
the repository: $DISTTRAIN_CORPUS_DIR, by default ~/.cache/disttrain/doctor_corpus.

    python -m bench.doctor_corpus fetch                  # from GitHub (and PyPI)
    python -m bench.doctor_corpus fetch --from-git DIR   # from local clones, no network

`--from-git DIR` reads each repository from a clone under DIR, bare or with a work tree,
however it was brought. The clone of owner/name is looked for at DIR/owner/name,
DIR/owner__name, DIR/owner+name or DIR/name (each also with `.git`), and where that
folder is not itself a git directory, in the one git directory directly inside it. A
file is read as commit:path (by its blob hash where the clone lacks the commit). A
file that comes from a release rather than a commit (the manifest's `release`, e.g.
`torchtitan==0.3.0`) is read from that release's wheel, found anywhere under DIR as
`name-version-*.whl` (`pip download name==version --no-deps` on a machine with network
brings it), or from a clone holding its blob.

Every file written is checked against its blob hash; a file already in the cache with
the right hash is kept. Nothing here runs in the test suite: the suite has no network
and needs no corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "tests" / "doctor_corpus" / "manifest.json"
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One public file: where it is upstream, what it hashes to, where it goes here."""

    file: str  # path in the cache, e.g. projects/owner__name/train.py
    repo: str  # owner/name on GitHub
    commit: str | None  # None when the file was read from a release instead
    path: str  # path in the repository (or in the release's wheel)
    blob: str  # git blob SHA-1 of the exact bytes
    lines: int
    licence: str  # SPDX id (LicenseRef-... where SPDX has none)
    release: str | None = None  # "dist==version": read from that wheel
    note: str | None = None


def load_manifest(path: Path = MANIFEST) -> list[Entry]:
    return [Entry(**e) for e in json.loads(path.read_text())]


def cache_dir() -> Path:
    """$DISTTRAIN_CORPUS_DIR, else ~/.cache/disttrain/doctor_corpus."""
    env = os.environ.get("DISTTRAIN_CORPUS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "disttrain" / "doctor_corpus"


def blob_sha1(data: bytes) -> str:
    """What `git hash-object` prints for a file holding `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def stale(root: Path, entries: list[Entry]) -> list[Entry]:
    """The entries whose file under `root` is absent or is not the pinned blob."""
    out = []
    for e in entries:
        p = root / e.file
        if not p.is_file() or blob_sha1(p.read_bytes()) != e.blob:
            out.append(e)
    return out


def ready_cache(entries: list[Entry] | None = None) -> Path | None:
    """The cache folder when it holds every manifest file with its pinned hash, else None."""
    root = cache_dir()
    entries = load_manifest() if entries is None else entries
    return root if root.is_dir() and not stale(root, entries) else None


def how_to_fetch(entries: list[Entry] | None = None) -> str:
    """One line: what the cache lacks and how to fill it."""
    root = cache_dir()
    entries = load_manifest() if entries is None else entries
    lacks = (
        f"{len(stale(root, entries))} of its {len(entries)} files are missing or changed in "
        if root.is_dir()
        else "it is not in "
    )
    return (
        f"the doctor's public corpus is not fetched ({lacks}{root}): run `python -m "
        "bench.doctor_corpus fetch` (network) or `python -m bench.doctor_corpus fetch "
        "--from-git DIR` (local clones), or point $DISTTRAIN_CORPUS_DIR at a fetched copy"
    )


# ----- where the bytes come from -------------------------------------------------------


def _git(gitdir: Path, *args: str) -> bytes | None:
    r = subprocess.run(["git", "-C", str(gitdir), *args], capture_output=True)
    return r.stdout if r.returncode == 0 else None


def _is_clone(p: Path) -> bool:
    """A bare clone (HEAD and objects/ at the top) or one with a work tree (.git)."""
    return ((p / "HEAD").is_file() and (p / "objects").is_dir()) or (p / ".git").exists()


def find_clone(root: Path, repo: str) -> Path | None:
    """The clone of `repo` under `root`, in one of the layouts the module docstring lists."""
    owner, name = repo.split("/")
    for base in (root / owner / name, root / f"{owner}__{name}", root / f"{owner}+{name}", root / name):
        for cand in (base, base.with_name(base.name + ".git")):
            if not cand.is_dir():
                continue
            if _is_clone(cand):
                return cand
            inner = [c for c in cand.iterdir() if c.is_dir() and _is_clone(c)]
            if len(inner) == 1:
                return inner[0]
    return None


def _from_clone(clone: Path, e: Entry) -> bytes | None:
    """commit:path; by the blob hash alone only when the clone lacks the commit (a shallow
    clone) or the entry has none (a release)."""
    if e.commit and _git(clone, "cat-file", "-e", f"{e.commit}^{{commit}}") is not None:
        return _git(clone, "show", f"{e.commit}:{e.path}")
    return _git(clone, "cat-file", "blob", e.blob)


def _from_wheel(wheel: Path, e: Entry) -> bytes | None:
    with zipfile.ZipFile(wheel) as z:
        return z.read(e.path) if e.path in z.namelist() else None


def _wheel_name(release: str) -> str:
    dist, version = release.split("==")
    return f"{dist.replace('-', '_')}-{version}-*.whl"


def _download_wheel(release: str, into: Path) -> Path | None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            release,
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(into),
            "-q",
        ],
        capture_output=True,
    )
    found = sorted(into.glob(_wheel_name(release)))
    return found[0] if r.returncode == 0 and found else None


def _download(e: Entry) -> bytes | None:
    url = RAW_URL.format(repo=e.repo, commit=e.commit, path=e.path)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.read()
    except OSError:
        return None


class Sources:
    """Where the bytes of an entry come from: local clones and wheels under `git_root`,
    or (when it is None) GitHub's raw files and PyPI's wheels."""

    def __init__(self, git_root: Path | None, scratch: Path):
        self.git_root, self.scratch = git_root, scratch
        self._wheels: dict[str, Path | None] = {}

    def _wheel(self, release: str) -> Path | None:
        if release not in self._wheels:
            if self.git_root is None:
                self._wheels[release] = _download_wheel(release, self.scratch)
            else:
                found = sorted(self.git_root.rglob(_wheel_name(release)))
                self._wheels[release] = found[0] if found else None
        return self._wheels[release]

    def read(self, e: Entry) -> tuple[bytes | None, str]:
        """The entry's bytes (None when no source has them) and where they were looked for."""
        if e.release:
            wheel = self._wheel(e.release)
            data = _from_wheel(wheel, e) if wheel else None
            if data is not None or self.git_root is None:
                return data, f"the wheel of {e.release}"
        if self.git_root is None:
            return _download(e), RAW_URL.format(repo=e.repo, commit=e.commit, path=e.path)
        clone = find_clone(self.git_root, e.repo)
        if clone is None:
            return None, f"no clone of {e.repo} under {self.git_root}"
        return _from_clone(clone, e), f"{clone} at {e.commit or e.release}"


# ----- the command ---------------------------------------------------------------------


def fetch(dest: Path, entries: list[Entry], sources: Sources) -> list[str]:
    """Write each entry missing from `dest` (or not its pinned blob); one line per file
    that could not be brought, naming where it was looked for."""
    problems = []
    for e in stale(dest, entries):
        data, where = sources.read(e)
        if data is None:
            problems.append(f"{e.file}: not found ({where})")
            continue
        got = blob_sha1(data)
        if got != e.blob:
            problems.append(f"{e.file}: blob {got} from {where}, the manifest pins {e.blob}")
            continue
        target = dest / e.file
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.doctor_corpus fetch",
        description="Bring the doctor's public corpus into the cache, each file "
        "at its pinned commit, checked against its blob hash.",
    )
    ap.add_argument(
        "--from-git", type=Path, metavar="DIR", help="read local clones (and wheels) under DIR instead of the network"
    )
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the cache (default $DISTTRAIN_CORPUS_DIR or ~/.cache/disttrain/doctor_corpus)",
    )
    args = ap.parse_args(argv)
    if args.from_git is not None and not args.from_git.is_dir():
        print(f"--from-git {args.from_git}: no such folder; give the folder that holds the clones", file=sys.stderr)
        return 2
    dest = args.dir or cache_dir()
    entries = load_manifest()
    with tempfile.TemporaryDirectory() as scratch:
        problems = fetch(dest, entries, Sources(args.from_git, Path(scratch)))
    for line in problems:
        print(line, file=sys.stderr)
    ok = len(entries) - len(problems)
    print(
        f"{ok} of {len(entries)} files in {dest}, each checked against its blob hash"
        + (f"; {len(problems)} not brought (above)" if problems else "")
    )
    return 1 if problems else 0
