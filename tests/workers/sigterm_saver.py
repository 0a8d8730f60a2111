"""A worker that, like the trainer on preemption, saves on SIGTERM and exits 0."""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]


def save_and_exit(signum, frame):
    (out / f"saved{rank}").write_text("ok")
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_exit)
(out / f"ready{rank}").write_text("ok")
while True:
    time.sleep(0.05)
