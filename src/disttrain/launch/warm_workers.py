"""Warm workers: torchrun's worker processes forked from one that has already imported
torch and disttrain, so a start or restart (a failed worker, a scale-down, a scale-up)
does not pay for a fresh interpreter's imports in every worker (about 4 s of the 8-11 s
on 2 cores, plus the 3 s that DistributedDataParallel's first construction spends
importing torch._dynamo).

`disttrain run` (any Python script or module but fast recovery's) imports `PRELOAD`
in the agent's process and forks from it, once per agent, a **server** that waits on
a Unix socket. torchrun then starts, for each worker, `python -m
disttrain.launch.warm_workers MODULE ARGS...`: a **stub** that imports nothing heavy,
sends the server its environment, working directory, arguments and standard streams,
and gets back the pid of a child that the server forks to run `python -m MODULE ARGS`
as `__main__`. The stub is what torchrun watches and signals:
- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the stub are passed to the
  child (a preemption: it saves and exits 0);
- the stub exits with the child's status, and a child killed by a signal makes the
  stub die of the same signal, so torchrun reports what it would have without this;
- a stub that dies (SIGKILL) has its child killed by the server at once;
- the server dies with its agent (`PR_SET_PDEATHSIG`), and the children with the server.
A stub that cannot reach a server (none started, or it died) runs the module in its
own interpreter, as torchrun would have: slower, never wrong.

Fork safety: the server is forked from the agent after its imports and before torchrun
starts (no CUDA context, no process group, no thread but those `import torch` starts),
and forks workers without starting anything either: what DataLoader workers rely on.
OMP_NUM_THREADS and the other variables read at import are the agent's; the child
applies the worker's own environment and `torch.set_num_threads` before the module runs.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
from typing import NoReturn

from disttrain.launch.worker_entry import announcer, keep_globals
from disttrain.launch.worker_watch import FORWARDED, watch
from disttrain.runtime import processes

SOCKET_ENV = "DISTTRAIN_WARM_SOCKET"
SWITCH_ENV = "DISTTRAIN_WARM_WORKERS"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint.state_dict", "disttrain.train.trainer")
"""What the server imports (and torch._dynamo, through `torch_compat.import_dynamo`:
DistributedDataParallel.__init__ reads its config, 3 s on first use); the state-dict
helpers: the checkpoint load."""
_HEADER = struct.Struct("!Q")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


# ----------------------------------------------------------------------------- server


def preload() -> None:
    """Import what every warm worker starts with: `PRELOAD` and torch._dynamo."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from disttrain.runtime.torch_compat import import_dynamo

    import_dynamo()


def start_server() -> tuple[int, str] | None:
    """Import `PRELOAD` in this process (the agent's, before torchrun starts), then fork
    the server from it, in a session of its own (a terminal's Ctrl-C reaches the agent,
    which passes it on, not the server). The server shares those imports copy-on-write,
    so the job pays for one interpreter's imports instead of the agent's and the
    server's. Its socket is bound before the fork, so a stub that comes early waits in
    the backlog. Returns the server's pid and the socket's path (for SOCKET_ENV; end it
    with `stop_server`), or None when this process has a CUDA context (it does not
    survive a fork: workers then start fresh), also when only a device count touched
    the driver, which the server finds out after its fork and says before this returns."""
    from disttrain.runtime import torch_compat

    preload()
    if sys.modules["torch"].cuda.is_initialized():
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="disttrain-warm-"), "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            usable = not torch_compat.cuda_fork_poisoned()
            os.write(ready_w, b"1" if usable else b"0")
            os.close(ready_w)
            if not usable:
                os._exit(0)
            os.setsid()
            # Every object the imports made moves to the collector's permanent generation:
            # a worker's collections (gc.collect in process-group shutdown, the automatic
            # ones while training) then scan only what the worker made, instead of about a
            # million objects (0.3 s each), and leave the shared pages unwritten.
            processes.freeze_long_lived(for_life=True)
            serve(listener)
        finally:
            os._exit(1)
    listener.close()
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        usable = ready.read(1) == b"1"
    if not usable:  # its workers could not use CUDA: they start in fresh interpreters
        stop_server((pid, path))
        return None
    return pid, path


def stop_server(server: tuple[int, str]) -> None:
    """Kill the server (its children die with it) and remove its socket's folder."""
    import shutil

    pid, path = server
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def serve(listener: socket.socket) -> NoReturn:
    """Fork one child per stub request on `listener` until the agent dies
    (PR_SET_PDEATHSIG)."""
    processes.die_with_parent()  # a server outliving its agent would keep forked workers alive
    processes.set_name("dt.warm-server")
    for sig in FORWARDED:  # a signal to the agent's group is the agent's to pass on
        signal.signal(sig, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if sel.get_map().get(key.fd) is not key:
                # Unregistered by an earlier event of this batch: a stub and its worker that
                # died together (the worker's end closed the stub's connection first).
                continue
            if key.data is None:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # close what belongs to the server and the other workers
                    for other in list(sel.get_map().values()):
                        if isinstance(other.fileobj, socket.socket):
                            other.fileobj.close()  # (os.close would leave the object to close a reused fd)
                        else:
                            os.close(other.fd)
                    sel.close()
                    _child(request, fds, conn)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                try:
                    conn.sendall(_HEADER.pack(pid))
                except OSError:  # the stub is gone already: so is its worker
                    os.kill(pid, signal.SIGKILL)
                sel.register(pidfd, selectors.EVENT_READ, (pid, conn))
                sel.register(conn, selectors.EVENT_READ, (pid, None))
            elif key.data[1] is not None:  # the child ended: its status to the stub
                pid, conn = key.data
                _, status = os.waitpid(pid, 0)
                sel.unregister(key.fd)
                os.close(key.fd)
                if conn.fileno() >= 0:
                    sel.unregister(conn)
                    try:
                        conn.sendall(_HEADER.pack(status))
                    except OSError:
                        pass
                    conn.close()
            else:  # the stub's end closed before its child ended: the stub was killed
                sel.unregister(key.fd)
                if isinstance(key.fileobj, socket.socket):  # the stub's end (registered as a socket)
                    key.fileobj.close()
                try:
                    os.kill(key.data[0], signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    if len(msg) < _HEADER.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed request")
    (size,) = _HEADER.unpack(msg)
    return json.loads(_recv_exact(conn, size)), fds


def _child(request: dict, fds: list[int], conn: socket.socket) -> NoReturn:
    """Become the stub's worker: its streams, environment, directory and arguments; run
    the module as `__main__` and exit with the status `python -m MODULE` would have.

    The exit waits for non-daemon threads and runs atexit handlers, as the interpreter
    does, then skips the teardown of every module (torch's: about 0.9 s on 2 cores, which
    a restart would wait for: torchrun notices a failed worker only once it has exited)."""
    import io

    processes.die_with_parent()
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()  # the stub's signals reach this process by pid, not by group
    sys.path[:] = _worker_sys_path(request["cwd"], request["env"].get("PYTHONPATH", ""))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    processes.name_worker(announce=announcer([request["module"], *request["args"]]))
    sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False))
    for name, fd in (("stdout", 1), ("stderr", 2)):  # as `python -u`: unbuffered
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                os.fdopen(fd, "wb", buffering=0, closefd=False), errors="backslashreplace", write_through=True
            ),
        )
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the server's OpenMP read the agent's value
    from disttrain.runtime.failures import record_native_crashes

    record_native_crashes()  # a native crash shows the Python line it happened at
    code = _run_module(request["module"], request["args"])
    from disttrain.runtime import exit_bound

    if code == 0:
        from disttrain import worker_notes

        worker_notes.note_finished(int(os.environ.get("RANK", "0")))
    exit_bound.end_process(code)  # a thread or destructor that never ends must not keep the rank


def _worker_sys_path(cwd: str, pythonpath: str) -> list[str]:
    """The `sys.path` that `python -m MODULE` in `cwd` with `pythonpath` starts with:
    cwd, then PYTHONPATH's entries, then this interpreter's own (stdlib, site-packages),
    not the agent's (whose first entry may be a console script's folder)."""
    agents = set(os.environ.get("PYTHONPATH", "").split(os.pathsep)) - {""}
    own = [p for p in sys.path[1:] if p not in agents]
    return list(dict.fromkeys([cwd, *[p for p in pythonpath.split(os.pathsep) if p], *own]))


def _run_module(module: str, args: list[str]) -> int:
    """`python -m MODULE ARGS`'s exit status, its uncaught exception printed as it would be."""
    import runpy

    sys.argv = ["-m", *args]
    # The agent this server was forked from may have imported it (worker_entry): under
    # `python -m` it would not be, and runpy warns when it is.
    sys.modules.pop(module, None)
    try:
        keep_globals(runpy.run_module(module, run_name="__main__", alter_sys=True))
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (reported as an uncaught exception would be)
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


# ----------------------------------------------------------------------------- stub


def run_stub(module: str, args: list[str]) -> int:
    """Have the server fork this worker; return its exit status (or die of its signal).
    Without a reachable server, run the module here."""
    path = os.environ.get(SOCKET_ENV, "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return _run_here(module, args)
    body = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(conn, [_HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        (pid,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    except OSError:  # the server died before forking (ConnectionError is an OSError)
        conn.close()
        return _run_here(module, args)

    def status_from_server() -> int | None:
        try:
            return _HEADER.unpack(_recv_exact(conn, _HEADER.size))[0]
        except ConnectionError:
            print(f"disttrain run: the warm server died while running pid {pid}.", file=sys.stderr)
            return None

    return watch(pid, status_from_server)


def _run_here(module: str, args: list[str]) -> int:
    import runpy

    sys.argv = ["-m", *args]
    keep_globals(runpy.run_module(module, run_name="__main__", alter_sys=True))
    return 0  # a SystemExit of the module's passes through, as under `python -m`


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m disttrain.launch.warm_workers MODULE [ARGS...]", file=sys.stderr)
        return 2
    return run_stub(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
