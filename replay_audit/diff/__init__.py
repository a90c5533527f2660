"""The diff engine: pure functions (stdlib + numpy) that compare two arms' token sequences and
margins. No torch, no database, no HTTP: it works on plain lists and arrays."""

from replay_audit.diff.answer import (
    Extractor,
    SemanticAgreement,
    extract_gsm8k,
    extractor_names,
    get_extractor,
    normalise_number,
    register_extractor,
    semantic_agreement,
)
from replay_audit.diff.category import Verdict, classify, judge
from replay_audit.diff.divergence import (
    cascade_length,
    exact_match,
    first_divergence,
    length_difference,
)
from replay_audit.diff.margin import (
    DEFAULT_TAU,
    GateRule,
    Margin,
    StepNumerics,
    first_near_tie,
    is_tie,
    margin,
    margin_from_logprobs,
    margin_from_top_k,
    margins_ulps_from_top_k,
    sort_top_k,
    step_numerics,
)
from replay_audit.formats import ulp_array

__all__ = [
    "DEFAULT_TAU",
    "Extractor",
    "GateRule",
    "Margin",
    "SemanticAgreement",
    "StepNumerics",
    "Verdict",
    "cascade_length",
    "classify",
    "exact_match",
    "extract_gsm8k",
    "extractor_names",
    "first_divergence",
    "first_near_tie",
    "get_extractor",
    "is_tie",
    "judge",
    "length_difference",
    "margin",
    "margin_from_logprobs",
    "margin_from_top_k",
    "margins_ulps_from_top_k",
    "normalise_number",
    "register_extractor",
    "semantic_agreement",
    "sort_top_k",
    "step_numerics",
    "ulp_array",
]
