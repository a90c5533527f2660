"""Where two token sequences part: exact match, first divergence step t*, cascade and length
differences. Pure: stdlib only.

Convention: `a` is the logged arm and `b` the replay arm (or arm A and arm B of a comparison).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step t* at which `a` and `b` differ; None when they are identical. If one is a
    strict prefix of the other, t* is the shorter one's length: where one arm stopped."""
    n = min(len(a), len(b))
    for t in range(n):
        if a[t] != b[t]:
            return t
    return None if len(a) == len(b) else n


def exact_match(a: Sequence[int], b: Sequence[int]) -> bool:
    """True when both arms produced the same token sequence."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True))


def cascade_length(a: Sequence[int], b: Sequence[int]) -> int:
    """T - t*: the number of steps from the first divergence to the end of the longer arm
    (the paper's L_cascade); 0 when the arms agree."""
    t_star = first_divergence(a, b)
    return 0 if t_star is None else max(len(a), len(b)) - t_star


def length_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """len(b) - len(a): positive when the replay arm ran longer than the logged arm."""
    return len(b) - len(a)
