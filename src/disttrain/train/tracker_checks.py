"""The trackers' set-up checks, before any rank trains: a W&B run in online mode without
an API key or without a way to its server, an MLflow store that MLflow will refuse (a
file store under MLflow 3 without MLFLOW_ALLOW_FILE_STORE=true) or a tracking server
that cannot be reached. Each is one `UserError` naming what is wrong and the fix.

Run by the launching process of `disttrain train` (`launch/preflight.py`, for the
trackers of `[log]`) and by a `dt.Job` script's rank 0 when the Job is built (its
trackers are known only there). Neither wandb nor mlflow is imported: the checks read
the environment, `~/.netrc` and open one TCP connection per server (a few seconds at
most), so a refusal comes before the ranks start, not as a traceback after they did.
"""

from __future__ import annotations

import netrc
import os
import socket
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from disttrain.errors import UserError

WANDB_HOST = "https://api.wandb.ai"
CONNECT_TIMEOUT_S = 5.0
"""How long a tracker's server may take to accept a connection before it is called
unreachable: a reachable one answers in well under a second."""


def wandb_mode(mode: str | None) -> str:
    """The mode a W&B run will have: `mode` (the tracker's or `log.wandb_mode`), else
    WANDB_MODE, else online ("dryrun" is W&B's old word for offline)."""
    chosen = (mode or os.environ.get("WANDB_MODE") or "online").strip().lower()
    return {"dryrun": "offline", "run": "online"}.get(chosen, chosen)


def _netrc_has(host: str) -> bool:
    """True when the netrc file W&B reads (NETRC, else ~/.netrc) has a password for `host`."""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _reach(url: str) -> str | None:
    """None when `url`'s host accepts a TCP connection, else why not (one phrase)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def check_wandb(mode: str | None, offline_fix: str) -> None:
    """Raise `UserError` when an online W&B run cannot start: no API key (WANDB_API_KEY,
    the netrc entry `wandb login` writes) or no connection to its server
    (WANDB_BASE_URL, else api.wandb.ai). `offline_fix` says how to log offline instead."""
    if wandb_mode(mode) != "online":
        return
    base = os.environ.get("WANDB_BASE_URL") or WANDB_HOST
    host = urlsplit(base).hostname or base
    keyed = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(host)
    if not keyed:
        raise UserError(
            f"W&B in online mode has no API key for {host}: set WANDB_API_KEY or run `wandb login` "
            f"once, or log offline ({offline_fix}; `wandb sync` uploads it later)."
        )
    why = _reach(base)
    if why is not None:
        raise UserError(
            f"W&B in online mode cannot reach {base} ({why}): check the network or WANDB_BASE_URL, "
            f"or log offline ({offline_fix}; `wandb sync` uploads it later)."
        )


def _allows_file_store() -> bool:
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true; 2 allows it."""
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1"):
        return True
    for dist in ("mlflow", "mlflow-skinny"):  # the full package, or the tracking-only one
        try:
            return int(metadata.version(dist).split(".")[0]) < 3
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return False  # a version that cannot be read is taken as today's (3)


def check_mlflow(tracking_uri: str | None, uri_key: str) -> None:
    """Raise `UserError` when MLflow will refuse the store at `tracking_uri` (None:
    MLFLOW_TRACKING_URI, else MLflow's default): a file store MLflow 3 does not allow,
    or a server that does not accept a connection. `uri_key` names the setting."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    scheme = urlsplit(uri).scheme
    # MLflow's default is ./mlruns (a file store) when that folder holds runs, else sqlite.
    file_store = scheme == "file" or (bool(uri) and scheme == "") or (not uri and Path("mlruns").is_dir())
    if file_store and not _allows_file_store():
        raise UserError(
            f"MLflow 3 refuses the file store {uri or './mlruns'} unless MLFLOW_ALLOW_FILE_STORE=true: "
            f"export MLFLOW_ALLOW_FILE_STORE=true, or set {uri_key} to sqlite:///mlflow.db or a server."
        )
    if scheme in ("http", "https"):
        why = _reach(uri)
        if why is not None:
            raise UserError(
                f"MLflow cannot reach the tracking server {uri} ({why}): start it or check the "
                f"network, or set {uri_key} to a local store (sqlite:///mlflow.db)."
            )


def check_trackers(specs: list, *, from_config: bool) -> None:
    """Every check above for the tracker objects `specs` (`trackers.resolve`). The fixes
    name the config's keys (`from_config`, `disttrain train`) or the tracker's fields."""
    from disttrain.train.trackers import MlflowTracker, WandbTracker

    offline = 'log.wandb_mode = "offline"' if from_config else 'dt.WandbTracker(mode="offline")'
    uri_key = "log.mlflow_tracking_uri" if from_config else "dt.MlflowTracker(tracking_uri=...)"
    for spec in specs:
        if isinstance(spec, WandbTracker):
            check_wandb(spec.mode, f"{offline} or WANDB_MODE=offline")
        elif isinstance(spec, MlflowTracker):
            check_mlflow(spec.tracking_uri, uri_key)
