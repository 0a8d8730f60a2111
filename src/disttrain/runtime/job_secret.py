"""The per-job secret that proves a store value comes from the job's own processes.

`disttrain run` makes a random secret for each job (`for_job`) and hands it to its ranks
in `SECRET_ENV`: the environment, which only the job's user and root can read, never
the command line or a file. Every value disttrain writes to a store it shares with
its ranks (fast recovery's store: `elastic.job_store`) is `seal`ed: an HMAC-SHA256 over
the key and the value, in front of the value. A reader `open`s it: a value whose tag
fails (written by a client that does not hold the secret, or cut short) is treated as
absent. A multi-node job needs the same secret on every node: the user exports it
(each node's launcher is a process of its own).

Imports no torch: the slot supervisor and the launcher use it before torch is loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from disttrain.errors import UserError

SECRET_ENV = "DISTTRAIN_JOB_SECRET"
"""The job's secret, hex-encoded: made by `disttrain run` for a one-node job (`for_job`), exported
by the user (the same on every node) for a multi-node one."""
_TAG = 32  # bytes of an HMAC-SHA256
_MIN_BYTES = 16


def new_secret() -> str:
    """A fresh random secret, hex-encoded (32 bytes)."""
    return secrets.token_hex(32)


def for_job(nodes: str) -> str | None:
    """The secret the launcher hands its ranks: None when the user's environment already
    holds one (checked here, not in every rank), else a fresh one. `nodes` is the
    launcher's `--nnodes`: a job of more than one node cannot share a secret that one
    launcher made, so it needs the user's (`UserError`, one line, saying how)."""
    if os.environ.get(SECRET_ENV):
        from_env()
        return None
    if nodes not in ("1", "1:1"):
        raise UserError(
            f"a fast-recovery job on more than one node needs the same {SECRET_ENV} on every node: "
            f'export {SECRET_ENV}="$(python3 -c "import secrets; print(secrets.token_hex(32))")" '
            f"once, and pass it to each node's disttrain run (never on a command line)."
        )
    return new_secret()


def from_env(environ: dict[str, str] | None = None) -> bytes:
    """The job's secret from `SECRET_ENV`. Raises `UserError` (one line) when it is
    missing, not hex, or shorter than 16 bytes."""
    raw = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if not raw:
        raise UserError(
            f"{SECRET_ENV} is not set: fast recovery's store accepts only values that carry the "
            f"job's secret, which `disttrain run` hands its ranks; start the job with disttrain run."
        )
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < _MIN_BYTES:
        raise UserError(f"{SECRET_ENV} must be at least {_MIN_BYTES} random bytes, hex-encoded.")
    return secret


def _tag(secret: bytes, key: str, value: bytes) -> bytes:
    # The key's length goes first, so (key, value) pairs never share a byte string.
    name = key.encode()
    return hmac.new(secret, len(name).to_bytes(4, "big") + name + value, hashlib.sha256).digest()


def seal(secret: bytes, key: str, value: bytes) -> bytes:
    """`value` as stored under `key`: its tag, then the value."""
    return _tag(secret, key, value) + value


def open_sealed(secret: bytes, key: str, stored: bytes) -> bytes | None:
    """The value `seal` stored under `key`; None when `stored` does not carry the tag
    of this key and this value under `secret` (compared in constant time)."""
    if len(stored) < _TAG:
        return None
    tag, value = stored[:_TAG], stored[_TAG:]
    return value if hmac.compare_digest(tag, _tag(secret, key, value)) else None
