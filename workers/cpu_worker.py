"""CPU worker entry point: `python workers/cpu_worker.py`.

The same as `replay-audit worker --queue cpu --device cpu`: replays targets marked
`"device": "cpu"` and runs no CUDA. One worker process unless `--processes K`.
"""

import sys

from replay_audit.cli import app

if __name__ == "__main__":
    app(["worker", "--queue", "cpu", "--device", "cpu", *sys.argv[1:]])
