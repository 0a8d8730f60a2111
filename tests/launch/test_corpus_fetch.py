"""bench/corpus_fetch.py: the corpus comes from local clones, checked blob by blob.

Each test builds a small repository of its own (our words, no public code), clones it
in the layouts `--from-git` accepts, and fetches from it into a cache folder: the network
path (GitHub's raw files) is the same loop with another source and is not run here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))

from bench.corpus_fetch import Entry, Sources, blob_sha1, fetch, find_clone  # noqa: E402
from bench.doctor_corpus import main  # noqa: E402

FIRST = b"def step(model):\n    return model\n"
SECOND = b"def step(model):\n    return None\n"


def _git(*args, cwd=None):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def upstream(tmp_path):
    """A repository with train.py changed once: (work tree path, first commit, second commit)."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "src").mkdir()
    commits = []
    for text in (FIRST, SECOND):
        (repo / "src" / "train.py").write_bytes(text)
        _git("add", ".", cwd=repo)
        _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c", cwd=repo)
        commits.append(_git("rev-parse", "HEAD", cwd=repo))
    return repo, commits[0], commits[1]


def _entry(commit, blob, file="projects/acme__trainer/src/train.py"):
    return Entry(file=file, repo="acme/trainer", commit=commit, path="src/train.py", blob=blob, lines=2,
                 licence="MIT")


@pytest.mark.parametrize("layout", ["acme/trainer", "acme__trainer.git", "acme+trainer/repo", "trainer"])
def test_a_file_is_read_at_its_pinned_commit_from_a_bare_clone_in_each_layout(upstream, tmp_path, layout):
    repo, first, _ = upstream
    clones = tmp_path / "clones"
    (clones / layout).parent.mkdir(parents=True)
    _git("clone", "-q", "--bare", str(repo), str(clones / layout))
    assert find_clone(clones, "acme/trainer") == clones / layout
    cache = tmp_path / "cache"
    entry = _entry(first, blob_sha1(FIRST))
    assert fetch(cache, [entry], Sources(clones, tmp_path)) == []
    assert (cache / entry.file).read_bytes() == FIRST  # the pinned commit's, not HEAD's


def test_a_clone_with_a_work_tree_serves_by_commit_and_path(upstream, tmp_path):
    repo, first, second = upstream
    clones = tmp_path / "clones" / "acme"
    clones.mkdir(parents=True)
    _git("clone", "-q", str(repo), str(clones / "trainer"))
    entries = [_entry(first, blob_sha1(FIRST)), _entry(second, blob_sha1(SECOND), file="real/train_later.py")]
    cache = tmp_path / "cache"
    assert fetch(cache, entries, Sources(tmp_path / "clones", tmp_path)) == []
    assert (cache / "real" / "train_later.py").read_bytes() == SECOND


def test_a_wrong_blob_or_a_missing_clone_is_one_line_and_nothing_is_written(upstream, tmp_path):
    repo, first, _ = upstream
    clones = tmp_path / "clones"
    _git("clone", "-q", "--bare", str(repo), str(clones / "acme" / "trainer"))
    cache = tmp_path / "cache"
    wrong = _entry(first, blob_sha1(SECOND))  # pins the later blob at the earlier commit
    [line] = fetch(cache, [wrong], Sources(clones, tmp_path))
    assert line.startswith(wrong.file) and blob_sha1(FIRST) in line and f"pins {wrong.blob}" in line
    assert not (cache / wrong.file).exists()
    other = Entry(**{**vars(_entry(first, blob_sha1(FIRST))), "repo": "acme/other"})
    [line] = fetch(cache, [other], Sources(clones, tmp_path))
    assert "no clone of acme/other" in line


def test_a_file_already_in_the_cache_with_its_blob_is_kept(upstream, tmp_path):
    repo, first, _ = upstream
    cache = tmp_path / "cache"
    entry = _entry(first, blob_sha1(FIRST))
    (cache / entry.file).parent.mkdir(parents=True)
    (cache / entry.file).write_bytes(FIRST)
    assert fetch(cache, [entry], Sources(tmp_path / "nowhere", tmp_path)) == []  # no source asked
    (cache / entry.file).write_bytes(b"edited\n")  # a changed copy is fetched again
    assert fetch(cache, [entry], Sources(tmp_path / "nowhere", tmp_path)) != []


def test_from_git_names_a_missing_folder_in_one_line(tmp_path, capsys):
    assert main(["fetch", "--from-git", str(tmp_path / "absent"), "--dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "absent" in err and "Traceback" not in err
