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


def test_plan_buckets_small_last_bucket_golden():
    # split from the end: the last bucket holds at most 3 elements, the first takes the remainder
    assert plan_buckets([4, 4, 4, 2, 1], 8, last_numel=3) == [[0], [1, 2], [3, 4]]
    assert plan_buckets([4, 4, 4], 8, last_numel=3) == [[0, 1], [2]]     # a lone oversize parameter at the end
    assert plan_buckets([], 8, last_numel=3) == []


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 60), st.integers(1, 60))
def test_plan_buckets_small_last_bucket_properties(sizes, limit, last):
    buckets = plan_buckets(sizes, limit, last_numel=last)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for k, b in enumerate(buckets):
        cap = last if k == len(buckets) - 1 else limit
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap
    # no two neighbouring buckets before the last could have been one: the split is greedy from the end
    for a, b in zip(buckets[:-2], buckets[1:-1]):
        assert sum(sizes[i] for i in a + b) > limit
