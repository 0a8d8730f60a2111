"""Worker: each rank appends 'rank,master_port,OMP_NUM_THREADS,store flag' to a file;
`--fail-rank R` makes rank R exit with status 3; `--raise-rank R` makes rank R raise
RuntimeError while the others wait in a barrier."""

import os
import sys

import disttrain as dt

with dt.distributed() as info:
    with open(sys.argv[1], "a") as f:
        f.write(f"{info.rank},{os.environ['MASTER_PORT']},{os.environ.get('OMP_NUM_THREADS')},"
                f"{os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE')}\n")
    dt.barrier()
    if "--fail-rank" in sys.argv and info.rank == int(sys.argv[sys.argv.index("--fail-rank") + 1]):
        sys.exit(3)
    if "--raise-rank" in sys.argv:
        if info.rank == int(sys.argv[sys.argv.index("--raise-rank") + 1]):
            raise RuntimeError("shapes do not match")
        dt.barrier()
