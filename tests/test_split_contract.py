"""The layer-split grammar (contracts.split): one parser for the engine, CONFIGURE and the console."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_console.app.fake_worker import build_status
from hydra_console.contracts.split import (
    SplitError,
    check_ranges,
    even_split,
    move_boundary,
    parse_counts,
    parse_split,
    ranges,
    split_arg,
)
from hydra_console.engine.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text, stages, expect",
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
        (None, 4, [(0, 5), (5, 10), (10, 14), (14, 18)]),  # even: the larger shares first
        (None, 1, [(0, 18)]),
    ],
)
def test_parse_split(text, stages, expect):
    assert parse_split(text, 18, stages) == expect


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
    with pytest.raises(SplitError, match=message):
        parse_split(text, 18, stages)
    assert issubclass(SplitError, UserError)  # the CLI prints it as one line, exit 2


def test_check_ranges_wants_a_contiguous_cover():
    check_ranges([(0, 5), (5, 18)], 18, 2)
    for bad, message in [
        ([(0, 5), (6, 18)], "contiguous"),
        ([(1, 5), (5, 18)], "contiguous"),
        ([(0, 5), (5, 17)], "cover 17 layers"),
        ([(0, 18)], "1 layer ranges for 2 stages"),
    ]:
        with pytest.raises(SplitError, match=message):
            check_ranges(bad, 18, 2)


def test_counts_helpers():
    assert even_split(18, 2) == [9, 9] and even_split(18, 4) == [5, 5, 4, 4]
    assert ranges([9, 9]) == [(0, 9), (9, 18)]
    assert split_arg([10, 8]) == "10/8"
    with pytest.raises(SplitError):
        even_split(2, 3)


# The inputs on which the engine and the console once disagreed, and a few more: the console's
# preview (split editor counts, its stand-in worker's /status) must be what the engine applies.
AGREEMENT = [(None, 18, 4), ("1,1,1", 10, 3), ("0/18", 18, 2), ("1,2", 18, 2), ("1,1,1", 19, 3), ("3/1", 7, 2)]


@pytest.mark.parametrize("text, n_layers, stages", AGREEMENT)
def test_console_preview_equals_what_the_engine_applies(text, n_layers, stages):
    from types import SimpleNamespace

    engine_ranges = parse_split(text, n_layers, stages)  # what build_pipeline / CONFIGURE apply
    preview = ranges(parse_counts(text, n_layers, stages))  # what the split editor shows
    args = SimpleNamespace(
        command="serve",
        peer=[f"127.0.0.1:{9000 + i}" for i in range(stages - 1)],
        split=text,
        layers=n_layers,
        startup_delay=0,
        rpc_host="127.0.0.1",
        rpc_port=1,
        host="127.0.0.1",
        port=0,
        model=None,
    )
    fake = [s.layers for s in build_status(args, 0.0).stages]
    assert preview == engine_ranges == fake


@given(counts=st.lists(st.integers(1, 12), min_size=2, max_size=5), delta=st.integers(-20, 20), data=st.data())
def test_move_boundary_keeps_total_and_stays_valid(counts, delta, data):
    b = data.draw(st.integers(0, len(counts) - 2))
    new = move_boundary(counts, b, delta)
    assert sum(new) == sum(counts) and min(new[1:]) >= 1 and new[0] >= 0
    assert [n for i, n in enumerate(new) if i not in (b, b + 1)] == [
        n for i, n in enumerate(counts) if i not in (b, b + 1)
    ]
    check_ranges(ranges(new), sum(counts), len(counts))
