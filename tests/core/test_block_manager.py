import pytest

from servelab.core.block_manager import BlockManager, num_blocks_for_memory


def test_allocate_grows_table_with_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 5) == [0, 1]
    assert bm.allocate_slots("b", 4) == [2]
    assert bm.allocate_slots("a", 8) == []  # still fits in two blocks
    assert bm.allocate_slots("a", 9) == [3]
    assert bm.get_block_table("a") == [0, 1, 3]
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_out_of_blocks_is_none_and_allocates_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots("a", 8) == [0, 1]
    assert bm.allocate_slots("b", 9) is None
    assert "b" not in bm.block_tables
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_in_order_and_reuses_them():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", 4)
    bm.allocate_slots("b", 2)
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.allocate_slots("c", 6) == [3, 0, 1]
    bm.free("b")
    bm.free("c")
    bm.free("c")  # freeing an unknown request is a no-op
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_contiguous_reservation_first_fit_and_fragmentation():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.reserve_contiguous("a", 8) == [0, 1]
    assert bm.reserve_contiguous("b", 4) == [2]
    assert bm.reserve_contiguous("c", 12) == [3, 4, 5]
    bm.free("a")
    bm.free("c")
    # 5 blocks free but the longest run is 3 (ids 3-5): a 4-block reservation fails.
    assert bm.num_free_blocks == 5
    assert bm.reserve_contiguous("d", 16) is None
    assert bm.reserve_contiguous("d", 12) == [3, 4, 5]
    bm.record_tokens("d", 5)
    assert bm.num_reserved_unused_slots() == 3 * 4 - 5 + 4  # b has filled none of its 4 slots
    with pytest.raises(RuntimeError):
        bm.allocate_slots("d", 13)
    bm.check_invariants()


def test_first_fit_sees_blocks_taken_by_paged_allocation():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("a", 8) == [0, 1]
    assert bm.allocate_slots("b", 4) == [2]
    bm.free("a")
    assert bm.reserve_contiguous("c", 8) == [0, 1]  # the first run of two free blocks
    assert bm.reserve_contiguous("d", 12) == [3, 4, 5]
    assert bm.allocate_slots("e", 1) is None
    bm.free("b")
    assert bm.allocate_slots("e", 1) == [2]
    bm.check_invariants()


def test_invariant_checker_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", 2)
    bm._free_block_ids.append(0)
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_blocks_for_memory():
    # 1 MiB budget, 1 KiB per token, 16 tokens per block -> 64 blocks
    assert num_blocks_for_memory(1 << 20, 1024, 16) == 64
