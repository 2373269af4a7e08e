"""The src writer's run lists: what travels to the writer per bucket (one tuple for rows of one
length at a constant file stride, as a dim-1 shard makes)."""

from __future__ import annotations

from streamload.save.gather import encode_runs


def test_rows_at_a_stride_are_one_tuple() -> None:
    # a [3, 8]-byte column shard of a [3, 32]-byte tensor at file offset 100, packed back to back
    runs = [("f", 100 + 32 * i, 8 * i, 8) for i in range(3)]
    assert encode_runs(runs, {"f": 0}).tolist() == [[0, 100, 0, 8, 3, 32]]


def test_breaks_where_the_pattern_does() -> None:
    runs = [
        ("a", 0, 0, 8),
        ("a", 32, 8, 8),
        ("a", 70, 16, 8),  # another stride
        ("b", 102, 24, 8),  # another file
        ("b", 200, 40, 8),  # not next in the buffer
        ("b", 300, 48, 4),  # another length
    ]
    rows = encode_runs(runs, {"a": 0, "b": 1}).tolist()
    assert rows == [
        [0, 0, 0, 8, 2, 32],
        [0, 70, 16, 8, 1, 0],
        [1, 102, 24, 8, 1, 0],
        [1, 200, 40, 8, 1, 0],
        [1, 300, 48, 4, 1, 0],
    ]
    expanded = [(r[1] + j * r[5], r[2] + j * r[3], r[3]) for r in rows for j in range(r[4])]
    assert expanded == [(off, at, n) for _f, off, at, n in runs]


def test_empty() -> None:
    assert encode_runs([], {}).shape == (0, 6)
