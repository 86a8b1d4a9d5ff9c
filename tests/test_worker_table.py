"""The worker's block table as the model states it (`model.contract.worker_table`).

The table an admission ships is rebuilt from the observation's hit and new
blocks, a copy-on-write destination back in its source's place; a running
request's new blocks are appended; a Mamba step's state and draft-state columns
and the column it reads the previous state from follow vLLM 0.33.0's
`preprocess_mamba` (the docstring's worked example with block size 4 and two
drafts, and the padded admission of docs/semantics.md).
"""

from __future__ import annotations

from model.contract.worker_table import appended, read_column, shipped_table, state_column, written_columns


def test_an_admission_ships_the_hit_then_the_new_blocks() -> None:
    assert shipped_table(((1, 2), (0, 3)), ((4,), (0, 6, 7, 8))) == ((1, 2, 4), (0, 3, 0, 6, 7, 8))
    # Group 1's hit block 3 was copied to 9 (a fine-grained hit): 9 stands in its place.
    assert shipped_table(((1, 2), (0, 3)), ((4,), (9, 6)), {(3, 9)}) == ((1, 2, 4), (0, 9, 6))
    # A copy of another block leaves the hit as it is.
    assert shipped_table(((1,), (3,)), ((4,), (9, 6)), {(5, 9)}) == ((1, 4), (3, 9, 6))


def test_a_running_request_appends_what_a_step_ships() -> None:
    assert appended(((1, 2), (0, 3)), ((), (5,))) == ((1, 2), (0, 3, 5))
    assert appended(((1,), (3,)), ((), ())) == ((1,), (3,))


def test_state_columns_follow_preprocess_mamba() -> None:
    # [A, B, C] + 2 drafts, block size 4: 2 computed + 3 scheduled ends at 5; state in block 1.
    assert state_column(5, 4) == 1
    assert list(written_columns(5, 2, 4)) == [1, 2, 3]
    assert list(written_columns(8, 0, 4)) == [1]
    # The previous step ended at 5 and its sample accepted one draft: read column 1 + 1.
    assert read_column(5, 1, 4) == 2
    # Just admitted with 2 computed tokens (a hit): the hit's block; nothing computed: nothing read.
    assert read_column(2, 0, 2) == 0
    assert read_column(0, 0, 2) is None
    # The padded admission (hit 2, 1 + 2 tokens, block size 2) writes column 2; after the
    # rejection a one-token step ends at 4 and writes column 1, reading column 2.
    assert state_column(5, 2) == 2 and state_column(4, 2) == 1 and read_column(5, 0, 2) == 2
