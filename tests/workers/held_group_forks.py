"""Worker: PAIRS worlds of 2 ranks forked from one interpreter that has imported torch,
each rank running held_group.py and then leaving through a real interpreter
finalization (the path whose gloo destructor aborted). One torch import for every
rank instead of one per rank; exit 1 naming each rank that did not exit 0.

    python held_group_forks.py PAIRS
"""

import gc
import os
import runpy
import socket
import sys
from pathlib import Path

from disttrain.launch.warm_workers import preload

preload()  # what `disttrain run`'s warm workers start with, once before the forks
gc.freeze()  # as the warm server does before its forks

HELD_GROUP = str(Path(__file__).with_name("held_group.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, port: int) -> None:
    """In the forked child: one rank of a world of 2, then the interpreter's own exit."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    runpy.run_path(HELD_GROUP, run_name="__main__")
    raise SystemExit(0)  # unwinds past the parent's loop: a normal finalization follows


def main(pairs: int) -> int:
    children = {}
    for pair in range(pairs):
        port = free_port()
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                run_rank(rank, port)
            children[pid] = f"pair {pair} rank {rank}"
    failed = []
    for pid, name in children.items():
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(f"{name} exited {os.waitstatus_to_exitcode(status)}")
    print("; ".join(failed) or f"{2 * pairs} ranks exited 0", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
