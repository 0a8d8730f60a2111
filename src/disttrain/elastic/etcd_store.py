"""Fast recovery's store on etcd (v2 API), so that the store the generations agree on
is not a process of one node (`disttrain run --rdzv-backend etcd`, docs/elastic.md).

Under the c10d rendezvous global rank 0's slot supervisor hosts a `TCPStore`, and the
loss of that node takes the store with it. Under the etcd rendezvous `disttrain run`
hands the ranks the etcd endpoint instead (`STORE_ENV`), and each rank's store is a
client of that etcd, which outlives any node of the job. Each rendezvous round of
torchrun has a directory of its own (`round_prefix`: the run id and the round's
MASTER_ADDR:MASTER_PORT), so a restarted job starts with an empty one.

`EtcdStore` is a `torch.distributed.Store`: the generations' process groups
rendezvous on it (gloo's keys through a `PrefixStore`), and `elastic.job_store` seals
the values the ranks write for each other, as on the TCP store. Keys are stored
base64url-encoded (one flat directory), values base64-encoded (etcd v2 values are
text). `add` is a compare-and-swap on etcd's modification index, retried at once on a
conflict; a wait polls the key every 2 to 5 milliseconds (a new group's rendezvous is a
chain of such waits, and each is on a recovery's critical path).
"""

from __future__ import annotations

import base64
import datetime
import os
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    import etcd

STORE_ENV = "DISTTRAIN_FAST_STORE"
"""Set by `disttrain run` for fast recovery under the etcd rendezvous: `etcd://HOST:PORT`."""
ROUND_ENV = "DISTTRAIN_FAST_ROUND"
"""On a node that joined a running job (`elastic.join_node`): the job's round directory,
which this node's own torchrun round does not name."""
POLL_S = (0.002, 0.005)
"""A wait's first and longest poll interval."""


def _etcd():
    """python-etcd, imported when a store is first made: every launcher imports this module
    and most talk to no etcd (the import is about 0.15 s of a launch's CPU)."""
    import etcd

    return etcd


def client_errors() -> type[Exception]:
    """The base class of python-etcd's errors (an unreachable etcd among them)."""
    return _etcd().EtcdException


def preload() -> None:
    """Import python-etcd now (a warm spare's start), not in a recovery."""
    _etcd()


def _key(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode()


def _value(value: str | bytes) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


class EtcdStore(dist.Store):
    """A torch store whose keys live in etcd under `prefix` (see the module)."""

    def __init__(self, client: etcd.Client, prefix: str, timeout: datetime.timedelta) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = "/" + prefix.strip("/") + "/"
        self._timeout = timeout
        self._read_at: dict[str, int | None] = {}
        """Per key: etcd's index when this store last read it (`wait_for_change`)."""
        self.set_timeout(timeout)

    def _read(self, key: str) -> etcd.EtcdResult | None:
        try:
            node = self.client.read(self.prefix + _key(key))
        except _etcd().EtcdKeyNotFound as absent:
            payload = absent.payload if isinstance(absent.payload, dict) else {}
            self._read_at[key] = payload.get("index") if isinstance(payload.get("index"), int) else None
            return None
        self._read_at[key] = node.etcd_index
        return node

    def set(self, key: str, value: str | bytes) -> None:
        self.client.write(self.prefix + _key(key), _value(value))

    def get(self, key: str) -> bytes:
        """The value of `key`, waiting for it up to the store's timeout (`LookupError` then)."""
        self.wait([key])
        node = self._read(key)
        if node is None:  # deleted between the wait and the read
            raise LookupError(f"key {key!r} not found in fast recovery's etcd store")
        return base64.b64decode(node.value)

    def read_once(self, key: str) -> bytes | None:
        """The value of `key`, or None when it is absent: one request, no wait (`get` makes
        three: the wait's check, then the read)."""
        node = self._read(key)
        return None if node is None else base64.b64decode(node.value)

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to the integer at `key` (0 when absent) atomically; the new value."""
        path = self.prefix + _key(key)
        while True:
            node = self._read(key)
            try:
                if node is None:
                    self.client.write(path, str(amount), prevExist=False)
                    return amount
                new = int(node.value) + amount
                if amount == 0:
                    return new
                self.client.write(path, str(new), prevIndex=node.modifiedIndex)
                return new
            except (_etcd().EtcdAlreadyExist, _etcd().EtcdCompareFailed, _etcd().EtcdKeyNotFound):
                continue  # another rank wrote first, or removed the key: read again

    def wait_for_change(self, key: str, timeout_s: float) -> bool:
        """Block until `key` is written or deleted after this store's last read of it (or,
        never read, after now), or `timeout_s` passed; whether it changed. One long-poll
        request (etcd's watch from the index that read saw), so a change made between the
        read and this call is not missed. Errors as `read_once`'s."""
        import urllib3  # python-etcd's own HTTP client

        since = self._read_at.get(key)
        # The short limit is the answer's; a connection (made anew after each watch that
        # timed out) gets the store's.
        limit = urllib3.Timeout(connect=self._timeout.total_seconds(), read=timeout_s)
        try:
            self.client.watch(self.prefix + _key(key), index=since + 1 if since else None, timeout=limit)
        except _etcd().EtcdWatchTimedOut:
            return False
        except _etcd().EtcdEventIndexCleared:  # etcd keeps its last 1,000 events: older ones changed it
            pass
        return True

    def check(self, keys: list[str]) -> bool:
        return all(self._read(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is set; `LookupError` after `timeout` (the store's by default)."""
        limit = (timeout or self._timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, POLL_S[0]
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise LookupError(f"timed out after {limit:.0f} s waiting for {keys} in fast recovery's etcd store")
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])

    def delete_key(self, key: str) -> bool:
        try:
            self.client.delete(self.prefix + _key(key))
            return True
        except _etcd().EtcdKeyNotFound:
            return False

    def remove_all(self) -> None:
        """Delete this store's directory, and with it the run id's directory that holds
        it (`round_prefix`: the rounds of a restarted run, the pointer a joining node
        reads): the job is done with every one."""
        path = self.prefix.rstrip("/")
        parent = path.rsplit("/", 1)[0]
        try:
            run_dir = parent.startswith("/disttrain/fast/") and parent.count("/") == 3
            self.client.delete(parent if run_dir else path, recursive=True, dir=True)
        except _etcd().EtcdKeyNotFound:
            pass


def configured() -> str | None:
    """The etcd endpoint `disttrain run` handed the ranks (`STORE_ENV`), or None (the
    store is the TCP store of global rank 0's slot supervisor)."""
    url = os.environ.get(STORE_ENV, "")
    return url.removeprefix("etcd://") or None


def run_prefix(run_id: str) -> str:
    """The directory of every round of the run `run_id`."""
    return f"disttrain/fast/{run_id}"


def round_prefix() -> str:
    """This rendezvous round's directory: torchrun's run id and the round's master address
    (on a node that joined: the job's, `ROUND_ENV`)."""
    joined = os.environ.get(ROUND_ENV)
    if joined:
        return joined
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"{run_prefix(run_id)}/{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}"


def connect(endpoint: str, timeout_s: float, prefix: str | None = None) -> EtcdStore:
    """A store on the etcd at `endpoint` (HOST:PORT), in this round's directory (or `prefix`)."""
    host, _, port = endpoint.rpartition(":")
    client = _etcd().Client(host=host or "127.0.0.1", port=int(port), read_timeout=max(5, int(timeout_s)))
    return EtcdStore(client, prefix or round_prefix(), datetime.timedelta(seconds=timeout_s))
