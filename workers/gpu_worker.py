"""GPU worker entry point: `python workers/gpu_worker.py [--device cuda:N]`.

The same as `replay-audit worker --queue gpu`: an RQ SimpleWorker that keeps each checkpoint
loaded. Run one per GPU, each with its own `CUDA_VISIBLE_DEVICES`: it runs two worker
processes on its GPU unless `--processes K` (or REPLAY_AUDIT_WORKER_PROCESSES) says otherwise.
"""

import sys

from replay_audit.cli import app

if __name__ == "__main__":
    app(["worker", "--queue", "gpu", *sys.argv[1:]])
