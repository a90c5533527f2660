"""First divergence, exact match, cascade and length differences: hand-built edge cases."""

from __future__ import annotations

import pytest

from replay_audit.diff import cascade_length, exact_match, first_divergence, length_difference


@pytest.mark.parametrize(
    ("a", "b", "t_star"),
    [
        ([1, 2, 3], [1, 2, 3], None),  # exact
        ([1, 2, 3], [9, 2, 3], 0),  # divergence at step 0
        ([1, 2, 3], [1, 2, 9], 2),  # at the last step
        ([1, 2, 3], [1, 2, 3, 4], 3),  # the logged arm is a strict prefix
        ([1, 2, 3, 4], [1, 2], 2),  # the replay arm stopped early
        ([], [], None),
        ([], [5], 0),
    ],
)
def test_first_divergence(a: list[int], b: list[int], t_star: int | None) -> None:
    assert first_divergence(a, b) == t_star
    assert first_divergence(b, a) == t_star  # symmetric
    assert exact_match(a, b) == (t_star is None)


def test_cascade_length_is_T_minus_t_star_over_the_longer_arm() -> None:
    assert cascade_length([1, 2, 3, 4], [1, 2, 3, 4]) == 0
    assert cascade_length([1, 2, 3, 4], [1, 9, 3, 4]) == 3
    assert cascade_length([1, 2, 3, 4], [9, 2, 3, 4]) == 4
    assert cascade_length([1, 2, 3, 4], [1, 2, 3, 9]) == 1
    assert cascade_length([1, 2], [1, 2, 7, 7, 7]) == 3


def test_length_difference_is_replay_minus_logged() -> None:
    assert length_difference([1, 2, 3], [1, 2, 3]) == 0
    assert length_difference([1, 2, 3], [1, 2, 3, 4, 5]) == 2
    assert length_difference([1, 2, 3], [1]) == -2
