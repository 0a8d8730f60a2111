"""Warm workers: torchrun's worker processes forked from one that has already imported
torch and disttrain, so a start or restart (a failed worker, a scale-down, a scale-up)
does not pay for a fresh interpreter's imports in every worker (about 4 s of the 8-11 s
on 2 cores, plus the 3 s that DistributedDataParallel's first construction spends
importing torch._dynamo).

`disttrain run` (any Python script or module but fast recovery's) starts, once per
agent and before the agent's own imports, a **server** (`python -m
disttrain.launch.warm_workers --serve SOCKET`) that imports `PRELOAD` and waits on a Unix socket. torchrun then starts, for
each worker, `python -m disttrain.launch.warm_workers MODULE ARGS...`: a **stub** that
imports nothing heavy, sends the server its environment, working directory, arguments
and standard streams, and gets back the pid of a child that the server forks to run
`python -m MODULE ARGS` as `__main__`. The stub is what torchrun watches and signals:
- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the stub are passed to the
  child (a preemption: it saves and exits 0);
- the stub exits with the child's status, and a child killed by a signal makes the
  stub die of the same signal, so torchrun reports what it would have without this;
- a stub that dies (SIGKILL) has its child killed by the server at once;
- the server dies with its agent (`PR_SET_PDEATHSIG`), and the children with the server.
A stub that cannot reach a server (none started, or it died) runs the module in its
own interpreter, as torchrun would have: slower, never wrong.

Fork safety: the server only imports (no CUDA context, no process group, no thread of
its own), which is what DataLoader workers rely on too. OMP_NUM_THREADS and the other
variables read at import are the agent's; the child applies the worker's own
environment and `torch.set_num_threads` before the module runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import NoReturn

SOCKET_ENV = "DISTTRAIN_WARM_SOCKET"
SWITCH_ENV = "DISTTRAIN_WARM_WORKERS"
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint.state_dict", "disttrain.train.trainer")
"""What the server imports (and torch._dynamo, through `torch_compat.import_dynamo`:
DistributedDataParallel.__init__ reads its config, 3 s on first use); the state-dict
helpers: the checkpoint load."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!Q")


def _die_with_parent() -> None:
    if sys.platform == "linux":  # a server outliving its agent would keep forked workers alive
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


# ----------------------------------------------------------------------------- server

def start_server() -> tuple[subprocess.Popen, str]:
    """Start the server (the agent's child, in a session of its own so a terminal's
    Ctrl-C reaches the agent, which passes it on, and not the server). Its socket is
    bound here, so a stub that comes before the imports are done waits in the backlog.
    Returns the process and the socket's path (for SOCKET_ENV); remove its folder at exit."""
    path = os.path.join(tempfile.mkdtemp(prefix="disttrain-warm-"), "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    proc = subprocess.Popen([sys.executable, "-m", "disttrain.launch.warm_workers", "--serve",
                             str(listener.fileno())], pass_fds=[listener.fileno()], start_new_session=True)
    listener.close()
    return proc, path


def serve(fd: int) -> NoReturn:
    """Import PRELOAD, then fork one child per stub request on the listening socket
    `fd`, until the agent dies (PR_SET_PDEATHSIG)."""
    _die_with_parent()
    for sig in FORWARDED:  # a signal to the agent's group is the agent's to pass on
        signal.signal(sig, signal.SIG_IGN)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from disttrain.runtime.torch_compat import import_dynamo

    import_dynamo()
    listener = socket.socket(fileno=fd)
    if sys.modules["torch"].cuda.is_initialized():  # a CUDA context does not survive fork:
        listener.close()  # stubs find no server and start their workers fresh
        os._exit(0)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
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

    _die_with_parent()
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()  # the stub's signals reach this process by pid, not by group
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False))
    for name, fd in (("stdout", 1), ("stderr", 2)):  # as `python -u`: unbuffered
        setattr(sys, name, io.TextIOWrapper(os.fdopen(fd, "wb", buffering=0, closefd=False),
                                            errors="backslashreplace", write_through=True))
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the server's OpenMP read the agent's value
    code = _run_module(request["module"], request["args"])
    from disttrain.runtime.torch_compat import finish_interpreter

    finish_interpreter()  # what the interpreter does at exit: join threads, run atexit
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _run_module(module: str, args: list[str]) -> int:
    """`python -m MODULE ARGS`'s exit status, its uncaught exception printed as it would be."""
    import runpy

    sys.argv = ["-m", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
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
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    try:
        (status,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    except ConnectionError:
        print(f"disttrain run: the warm-worker server died while running pid {pid}.", file=sys.stderr)
        return 1
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the child's signal, so torchrun reports it as its own
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _run_here(module: str, args: list[str]) -> int:
    import runpy

    sys.argv = ["-m", *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0  # a SystemExit of the module's passes through, as under `python -m`


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(int(argv[1]))
    if not argv:
        print("usage: python -m disttrain.launch.warm_workers MODULE [ARGS...]", file=sys.stderr)
        return 2
    return run_stub(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
