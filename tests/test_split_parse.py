"""`--split` syntax (DESIGN §3): counts or proportions, head first, explicit ranges out."""

from __future__ import annotations

import pytest

from hydra_console.engine.errors import UserError
from hydra_console.engine.pipeline import check_ranges, parse_split


@pytest.mark.parametrize(
    "text, stages, ranges",
    [
        ("9/9", 2, [(0, 9), (9, 18)]),
        ("9,9", 2, [(0, 9), (9, 18)]),
        ("12/6", 2, [(0, 12), (12, 18)]),
        ("6/6/6", 3, [(0, 6), (6, 12), (12, 18)]),
        ("1,1", 2, [(0, 9), (9, 18)]),  # proportions: normalised to the layer count
        ("0.25/0.75", 2, [(0, 4), (4, 18)]),  # 4.5 rounds half to even
        ("2/1/1", 3, [(0, 9), (9, 14), (14, 18)]),
        ("0/18", 2, [(0, 0), (0, 18)]),  # a head holding no layer: embedding and output only
        (None, 3, [(0, 6), (6, 12), (12, 18)]),
        (None, 1, [(0, 18)]),
    ],
)
def test_parse_split(text, stages, ranges):
    assert parse_split(text, 18, stages) == ranges


@pytest.mark.parametrize(
    "text, stages, message",
    [
        ("9/9", 3, "has 2 stages but the pipeline has 3"),
        ("9/x", 2, "expected numbers"),
        ("9/-1", 2, ">= 0"),
        ("0/0", 2, "not all 0"),
        ("nan/1", 2, ">= 0"),
        ("inf/1", 2, "finite"),
        ("18/0", 2, "would hold no layer"),
        ("17/0.5/0.5", 3, "would hold no layer"),
    ],
)
def test_bad_splits_are_user_errors(text, stages, message):
    with pytest.raises(UserError, match=message):
        parse_split(text, 18, stages)


def test_check_ranges_wants_a_contiguous_cover():
    check_ranges([(0, 5), (5, 18)], 18, 2)
    for ranges, message in [
        ([(0, 5), (6, 18)], "contiguous"),
        ([(1, 5), (5, 18)], "contiguous"),
        ([(0, 5), (5, 17)], "cover 17 layers"),
        ([(0, 18)], "1 layer ranges for 2 stages"),
    ]:
        with pytest.raises(UserError, match=message):
            check_ranges(ranges, 18, 2)
