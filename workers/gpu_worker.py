"""GPU worker entry point: `python workers/gpu_worker.py [--device cuda:N]`.

The same as `replay-audit worker --queue gpu`: an RQ SimpleWorker that keeps each checkpoint
loaded. Run one per GPU, each with its own `CUDA_VISIBLE_DEVICES`.
"""

import sys

from replay_audit.cli import app

if __name__ == "__main__":
    app(["worker", "--queue", "gpu", *sys.argv[1:]])
