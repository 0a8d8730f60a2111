"""No tracked file is a copy of the doctor's public corpus (issue 39).

tests/doctor_corpus/manifest.json pins every public file the doctor is measured on by its
git blob SHA-1; the files themselves live in a cache outside the repository. These tests
compare the blob of every tracked file, as committed (the index) and as it is in the work
tree, against the manifest, and check the manifest holds facts in one shape.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))

from bench.corpus_fetch import MANIFEST, blob_sha1, load_manifest  # noqa: E402

SPDX = re.compile(r"(LicenseRef-[A-Za-z0-9.-]+|[A-Za-z0-9.+-]+)")


def tracked_blobs(root) -> dict[str, str]:
    """path -> blob SHA-1 of every tracked file, both as in the index and in the work tree
    (a path whose two differ appears once per blob, the work tree's with a ' (work tree)'
    suffix)."""
    staged = subprocess.run(["git", "-C", str(root), "ls-files", "-s", "-z"], capture_output=True, check=True)
    out = {}
    for rec in staged.stdout.decode().split("\0"):
        if rec:
            meta, path = rec.split("\t", 1)
            out[path] = meta.split()[1]
            p = root / path
            if p.is_file() and not p.is_symlink():
                work = blob_sha1(p.read_bytes())
                if work != out[path]:
                    out[path + " (work tree)"] = work
    return out


def copies_of_corpus(blobs: dict[str, str], manifest) -> list[str]:
    pinned = {e.blob: e for e in manifest}
    return [f"{path} is {pinned[b].repo} {pinned[b].path}" for path, b in sorted(blobs.items()) if b in pinned]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_tracked_file_is_a_copy_of_a_corpus_file():
    blobs = tracked_blobs(ROOT)
    assert len(blobs) > 100
    assert copies_of_corpus(blobs, load_manifest()) == []


def test_the_check_names_a_copy(tmp_path):
    """The comparison itself: a file whose blob the manifest pins is named, others not."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "ours.py").write_text("print('ours')\n")
    (tmp_path / "theirs.py").write_text("print('theirs')\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    manifest = [e for e in load_manifest()[:1]]
    pinned = manifest[0].__class__(**{**vars(manifest[0]), "blob": blob_sha1(b"print('theirs')\n")})
    assert copies_of_corpus(tracked_blobs(tmp_path), [pinned]) == [f"theirs.py is {pinned.repo} {pinned.path}"]
    (tmp_path / "ours.py").write_text("print('theirs')\n")  # changed in the work tree only
    assert len(copies_of_corpus(tracked_blobs(tmp_path), [pinned])) == 2


def test_the_manifest_is_facts_in_one_shape():
    entries = load_manifest()
    assert len(entries) >= 300
    assert len({e.file for e in entries}) == len(entries)
    for e in entries:
        assert re.fullmatch(r"[0-9a-f]{40}", e.blob), e
        assert (e.commit is not None and re.fullmatch(r"[0-9a-f]{40}", e.commit)) or e.release, e
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e.repo) and e.lines > 0 and SPDX.fullmatch(e.licence), e
        assert e.file.startswith(("projects/", "real/")) and ".." not in e.file.split("/"), e
    assert MANIFEST.read_text().count("\n") == len(entries) + 2  # one line per entry: diffs stay readable
