"""replay-audit: cross-precision replay and audit of LLM inference.

Does a logged greedy generation replay exactly in another numerical format? Where does it first
diverge (t*), with what top-two margin, why (head-reachable, KV-dependent or body-dominated), and
would the gated FP32 lm_head recompute (Intervention C) have prevented it?
"""

__version__ = "0.1.0"
