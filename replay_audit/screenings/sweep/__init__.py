"""Screening a checkpoint on a platform before deploying it (the paper's practitioner decision
procedure as a tool): a one-knob-at-a-time sensitivity sweep against a reference
configuration, trigger density and CV(TD), the hidden-state gap at gated steps, categories,
the both-arms C lift, a tier and a recommended action. docs/screening.md.

    plan.py      what runs (configurations, knobs, the pair, the gate), what cannot run here
    outputs.py   what is stored: each run's decodes, each comparison's probes
    runner.py    producing them through the `Engine` protocol (torch-free), resumable
    analysis.py  the report from stored outputs (pure), with density.py and tier.py
    report.py    the report's typed form
    worker.py    the torch backend (workers and the CLI only)
"""
