"""The pure parts of a checkpoint's index: fragment coverage and the same-layout test."""

from shardwise.checkpoint.index import covered, same_layout

# Two ZeRO ranks, one bucket [a (6 elements), b (4)] padded to 10, shards of 5: rank 0 holds a[0:5], rank 1
# a[5:6] and b[0:4]. Fragments are (tp rank, lo, hi, entry, dst).
ENTRIES = [("zero_pp_rank_0_mp_rank_00_optim_states.pt", "optimizer_state_dict", 0, 0, 5, {"lr": 0.1}),
           ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "optimizer_state_dict", 0, 0, 5, {"lr": 0.1})]
INDEX = {"dims": {"dp": 2, "tp": 1, "pp": 1}, "entries": ENTRIES,
         "fragments": {"a": [(0, 0, 5, 0, 0), (0, 5, 6, 1, 0)], "b": [(0, 0, 4, 1, 1)]}}


def test_covered_needs_every_element_of_the_slice():
    assert covered(INDEX["fragments"]["a"], 0, 6)
    assert not covered(INDEX["fragments"]["a"][:1], 0, 6)            # a[5] is missing
    assert not covered([(0, 1, 6, 0, 0)], 0, 6)                      # a[0] is missing
    assert not covered(INDEX["fragments"]["a"], 1, 6)                # no TP rank 1 here


def test_same_layout_compares_this_ranks_entries_and_fragments():
    rank1 = {"entries": [ENTRIES[1][:5] + ({"lr": 0.05},)],         # the lr may have moved: not compared
             "fragments": {"a": [(0, 5, 6, 0, 0)], "b": [(0, 0, 4, 0, 1)]}}
    assert same_layout(INDEX, rank1, {"dp": 2, "tp": 1, "pp": 1})
    assert not same_layout(INDEX, rank1, {"dp": 4, "tp": 1, "pp": 1})
    moved = {"entries": rank1["entries"], "fragments": {"a": [(0, 5, 6, 0, 0)], "b": [(0, 0, 4, 0, 2)]}}
    assert not same_layout(INDEX, moved, {"dp": 2, "tp": 1, "pp": 1})
    bigger = {"entries": [ENTRIES[1][:4] + (6, {})], "fragments": rank1["fragments"]}
    assert not same_layout(INDEX, bigger, {"dp": 2, "tp": 1, "pp": 1})
