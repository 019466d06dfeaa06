from hypothesis import given, strategies as st

from shardwise.parallel.data_parallel import plan_buckets


def test_plan_buckets_golden():
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([10, 1, 1], 8) == [[0], [1, 2]]
    assert plan_buckets([], 8) == []


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 60))
def test_plan_buckets_properties(sizes, limit):
    buckets = plan_buckets(sizes, limit)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))   # order kept, each once
    for b in buckets:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= limit          # only a lone oversize param exceeds
