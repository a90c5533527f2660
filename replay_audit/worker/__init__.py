"""Worker side: the job functions the runners call, and the per-process engine pool.

Imported only by worker processes and the in-process runner's thread, never by the API request
path: it reaches torch (through `replay_audit.engine.load_engine`) when a job runs.
"""
