"""Screening a checkpoint on a platform before deploying it (the paper's practitioner decision
procedure as a tool): a one-knob-at-a-time sensitivity sweep against a reference
configuration, trigger density and CV(TD), the hidden-state gap at gated steps, categories,
the both-arms C lift, a tier and a recommended action. docs/screening.md. Only `worker.py`
imports torch (workers and the CLI only).
"""
