"""The replay: from a request to its typed outcome, its rows and its statistics.

domain       the values, defined once: RunTarget, Comparison, LoggedTrace, ArmMargin,
             ArmOutcome, SingleStep, ReplayOutcome (pure)
schemas      the HTTP contract: ReplayCreate, ReplayRead, ReplayResultRead
models       the tables: replay_runs, replay_jobs, replay_results
service      create a run (select traces, plan jobs, enqueue after commit), read it
repository   all SQL of the domain (runs, jobs, results, the figures the statistics read)
results      the one mapping outcome -> row and row -> ReplayResultRead
statistics   a run's statistics through the one builder (`replay_audit.stats.report`)
endpoints    `/v1/replays`
tasks        the job a worker runs (imports the engine at run time; never the API process)
pipeline     the one replay pipeline: arms resolved, run through the engine, one outcome rule
reconcile    re-enqueue what the database says is unfinished
"""
