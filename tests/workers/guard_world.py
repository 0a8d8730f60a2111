"""Worker: run as ONE plain process while DISTTRAIN_EXPECTED_WORLD_SIZE asks for more."""

import disttrain as dt
from disttrain import sanity

with dt.distributed(seed=0):
    sanity.check_world_size()
