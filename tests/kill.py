"""Run a script in a child process and SIGKILL it once it has written a given file (a checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_until_then_kill(script: str, args: dict, marker: Path, tmp: Path, threads: int, timeout: float = 150) -> None:
    """Run ``script`` (Python source, args as JSON in argv[1]) until ``marker`` exists, then SIGKILL it."""
    path = tmp / "child.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    log = tmp / "child.stderr"  # a file, not a pipe: a full pipe would stall the child
    with log.open("wb") as err:
        child = subprocess.Popen([sys.executable, str(path), json.dumps(args)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if child.poll() is not None:  # finished (or failed) before the marker: the kill would test nothing
                raise AssertionError(f"the child exited (rc {child.returncode}) before writing {marker.name}; "
                                     f"its stderr ends:\n{log.read_text(errors='replace')[-2000:]}")
            assert time.monotonic() < deadline, f"the child did not write {marker.name} in time"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
