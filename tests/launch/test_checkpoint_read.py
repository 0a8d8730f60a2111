"""The raw-1 load's reads (checkpoint/raw_read.py): the reader of other ranks' files
reads only cached bytes until this rank's share is done, then reads on; a storage
that records of two files target is found; the prefetch stops when asked; the
load's threads are kept per process, and a forked child makes its own; the ranks
agree on a load's problems with a flag first, the messages only when one has any."""

from __future__ import annotations

import multiprocessing
import os
import threading
from types import SimpleNamespace

import pytest
import torch

from disttrain.checkpoint import CheckpointCorrupt
from disttrain.checkpoint.hashing_fs import problems
from disttrain.checkpoint.raw_read import pool, prefetch_share, read_all, read_cached, shared_storages, stop_for


def test_read_cached_reads_the_bytes_and_the_rest_once_done(tmp_path):
    data = bytes(range(256)) * 4096
    path = tmp_path / "__1_0.distcp"
    path.write_bytes(data)
    buf = bytearray(len(data) - 10)
    done = threading.Event()
    with open(path, "rb", buffering=0) as f:
        f.seek(10)
        read_cached(f, memoryview(buf), path, done)  # just written: in the page cache
        assert f.tell() == len(data)
    assert bytes(buf) == data[10:]
    done.set()
    with open(path, "rb", buffering=0) as f, pytest.raises(CheckpointCorrupt, match="truncated"):
        read_cached(f, memoryview(bytearray(len(data) + 1)), path, done)


def test_shared_storages_are_those_two_files_target():
    tied, own = torch.zeros(4), torch.zeros(4)
    item = lambda t: SimpleNamespace(type=SimpleNamespace(name="TENSOR"), t=t)  # noqa: E731
    per_file = {"__0_0.distcp": {"a": [item(tied)], "b": [item(own)]}, "__1_0.distcp": {"c": [item(tied[:2])]}}
    assert shared_storages(per_file, lambda i: i.t) == {tied.untyped_storage().data_ptr()}


def test_read_all_keeps_the_order_and_waits_for_both_threads():
    seen = []

    def read(name, cached):
        seen.append((name, cached is None))
        if name == "__1_0.distcp":
            raise CheckpointCorrupt("bad", name)
        return name

    names = ["__2_0.distcp", "__0_0.distcp", "__1_0.distcp"]
    with pytest.raises(CheckpointCorrupt):
        read_all(names, lambda n: n == "__2_0.distcp", read)
    assert sorted(seen) == [("__0_0.distcp", False), ("__1_0.distcp", False), ("__2_0.distcp", True)]
    assert read_all(names[:2], lambda n: n == "__2_0.distcp", lambda n, c: n) == names[:2]


def test_read_all_reads_the_other_ranks_files_at_once():
    """Each other file has a reader of its own: a reader that waits on its rank (here,
    on the other reader) does not hold back the rest. With one reader for all of them
    this waits out the timeout."""
    second_started = threading.Event()
    threads = {}

    def read(name, cached):
        threads[name] = threading.get_ident()
        if name == "__1_0.distcp":
            assert second_started.wait(10), "the files after the first waited for it"
        if name == "__2_0.distcp":
            second_started.set()
        return name

    names = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert read_all(names, lambda n: n == "__0_0.distcp", read) == names
    assert threads["__1_0.distcp"] != threads["__2_0.distcp"] != threads["__0_0.distcp"]


def test_prefetch_of_this_ranks_share_stops_when_asked(tmp_path):
    from disttrain.checkpoint import raw_read

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "__1_0.distcp").write_bytes(b"y" * 100)
    hold = threading.Event()
    pool("prefetch").submit(hold.wait, 10)  # the one prefetch thread is busy: ours queues
    prefetch_share(tmp_path, 1, 2)
    stop = raw_read._PREFETCH[tmp_path]
    assert not stop.is_set()
    stop_for(tmp_path)
    assert stop.is_set()  # the queued read sees it at once and reads nothing
    hold.set()
    pool("prefetch").submit(lambda: None).result(timeout=10)  # the prefetch has ended
    assert tmp_path not in raw_read._PREFETCH
    stop_for(tmp_path)  # a second call finds nothing to stop
    prefetch_share(tmp_path / "missing", 0, 2)  # a directory that cannot be listed: nothing starts
    assert tmp_path / "missing" not in raw_read._PREFETCH


def test_load_threads_are_kept_and_a_forked_child_makes_its_own():
    assert pool("read") is pool("read") and pool("read") is not pool("hash")
    parent = pool("read").submit(threading.get_ident).result(timeout=10)
    assert pool("read").submit(threading.get_ident).result(timeout=10) == parent  # one thread, kept
    pid = os.fork()
    if pid == 0:  # the parent's pool has no thread here: a reused one would never run this
        ok = False
        try:
            ok = pool("read").submit(lambda: 7).result(timeout=10) == 7 and pool("read") is pool("read")
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _agree_in_rank(rank: int, store_path: str, mine: list, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    pg = dist.new_group(backend="gloo")

    from disttrain.runtime.collectives import all_gather_json

    def gather(obj, shape):
        return all_gather_json(obj, group=pg, shape=shape)

    out.put((rank, [problems(m, pg, gather) for m in mine]))
    dist.destroy_process_group()


def test_ranks_agree_on_problems_only_one_of_them_has(tmp_path):
    """Two real gloo ranks: no problem anywhere is [] on both; a problem on either rank
    alone is every rank's list on both (the flag said so to the rank without one)."""
    mine = {0: [None, None, ("__0_0.distcp", "bad")], 1: [None, ("", "", "other model"), None]}
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_in_rank, args=(r, str(tmp_path / "store"), mine[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=60) for _ in procs)  # a hang fails here, not forever
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = [[], [None, ("", "", "other model")], [("__0_0.distcp", "bad"), None]]
    assert got[0] == got[1] == expected
