"""A worker process's plumbing: its context (settings, engine pool) and where it finds a
trace's checkpoint. Below the domain packages: every job's runner takes these."""
