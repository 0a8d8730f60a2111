"""Fast recovery's store, as the job's processes use it: values sealed with the job's
secret, and a server that listens only where the job does.

- `JobStore` wraps a torch store: `set` seals each value (`runtime.job_secret`: an
  HMAC-SHA256 over key and value, keyed by the secret `disttrain run` handed the
  ranks), and `get` returns None for a value whose tag fails, with one log line per
  key. A client outside the job can still connect, read, overwrite or delete keys (a
  `TCPStore` has no authentication); what it cannot do is make a rank act on a value
  it wrote. The counters (`add`) and torch's own keys (the process groups' rendezvous)
  are not sealed.
- `host_store` serves it listening only on the address MASTER_ADDR resolves to
  (`runtime.store_server`; torch's own `TCPStore` server listens on every interface).
- Under the etcd rendezvous the store is etcd itself (`elastic.etcd_store`), which no
  node of the job hosts, and the sealing is the same.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from disttrain.elastic import etcd_store
from disttrain.runtime import job_secret
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker
from disttrain.runtime.store_server import hosted_store


class JobStore:
    """A store whose values disttrain seals and checks (see the module)."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        self.store = store
        self._secret = secret
        self._refused: set[str] = set()

    def set(self, key: str, value: str) -> None:
        # torch types the value as str; bytes are stored exactly as given
        self.store.set(key, job_secret.seal(self._secret, key, value.encode()))  # type: ignore[arg-type]

    def get(self, key: str) -> str | None:
        """The value of `key`; None when it is absent, or when it does not carry the
        job's seal (said once per key: a client outside the job wrote it)."""
        raw = self._raw(key)
        if raw is None:
            return None
        value = job_secret.open_sealed(self._secret, key, raw)
        if value is not None:
            try:
                return value.decode()
            except UnicodeDecodeError:  # sealed by the job, so never; kept as absent all the same
                return None
        if key not in self._refused:
            self._refused.add(key)
            LOGGER.warning(
                f"{speaker()}: ignored the value of {key} on fast recovery's store: it does not carry "
                f"the job's secret (a client outside the job wrote it)",
                extra=EVERY_RANK,
            )
        return None

    def _raw(self, key: str) -> bytes | None:
        """The stored bytes of `key`, None when absent: in one request on the etcd
        (`EtcdStore.read_once`); a TCP store's `get` would wait for a missing key."""
        if isinstance(self.store, etcd_store.EtcdStore):
            return self.store.read_once(key)
        if not self.store.check([key]):
            return None
        try:
            return self.store.get(key)
        except LookupError:  # removed since the check (the last slot out removes the round's keys)
            return None

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)


def connect(timeout_s: float) -> JobStore:
    """A client of the job's store, with the job's secret (`UserError` when the rank has
    none): under the etcd rendezvous the etcd `disttrain run` named (`elastic.etcd_store`:
    no node hosts it), else the slot supervisor's TCP store (it may still be starting:
    the client retries)."""
    secret = job_secret.from_env()
    endpoint = etcd_store.configured()
    if endpoint is not None:
        return JobStore(etcd_store.connect(endpoint, timeout_s), secret)
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return JobStore(store, secret)


def host_store(timeout_s: float) -> dist.Store:
    """The TCP store global rank 0's slot supervisor hosts at MASTER_ADDR:MASTER_PORT,
    listening only on MASTER_ADDR's address (`runtime.store_server.hosted_store`). Not
    used under the etcd rendezvous, where the store is the etcd (`connect`)."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    one_node = os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
    return hosted_store(
        host,
        port,
        one_node=one_node,
        what="fast recovery's store",
        timeout_s=timeout_s,
        world_size=None,
        wait_for_workers=False,
    )
