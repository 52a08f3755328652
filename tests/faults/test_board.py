"""The status board's words, read and written by two ranks' views of one
board in this process's memory (commlib.faults.board.StatusBoard): what a
rank publishes when it leaves must not overwrite what its peers still read,
and a wait for a word a peer has not written yet gives up only at the
deadline."""
import re
import subprocess
import time

import numpy as np
import pytest

from commlib.core.fingerprints import CODES
from commlib.core.waiting import Wait
from commlib.errors import CollectiveTimeoutError, PeerError
from commlib.faults import board

ALL_REDUCE = CODES["all_reduce"]


def ranks(n):
    memory = np.zeros(n * board.LINE_BYTES, np.uint8)
    views = [board.StatusBoard(memory, r, n) for r in range(n)]
    for view in views:
        view.join()
    return views


def two_ranks():
    return ranks(2)


def ended_pid():
    """The process id of a process that has ended (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("reason", sorted(board.REASONS))
def test_a_rank_that_left_later_and_whose_process_ended_is_named_dead(reason):
    """Rank 1 leaves after collective 1 (for any reason) and its process
    ends while rank 0 still waits in collective 1: rank 0 learns it from
    rank 1's process id, which leaving must leave as it was."""
    rank0, rank1 = two_ranks()
    pid = ended_pid()
    rank1.words[board.STRIDE + board.PID] = pid
    rank1.leave(1, reason, "gone", blame=(0,))
    with pytest.raises(PeerError, match=r"^rank 0: rank 1 \(pid %d\) died while this rank waits "
                                        r"in all_reduce #1$" % pid) as info:
        rank0.check_peers(1, ALL_REDUCE)
    assert info.value.culprits == (1,)


@pytest.mark.parametrize("observer,gave_up,cause", [
    (0, 1, 2), (0, 2, 1), (2, 0, 1), (1, 3, 0), (3, 0, 2), (1, 0, 3)])
def test_the_rank_that_left_by_itself_is_named_before_one_that_gave_up(observer, gave_up,
                                                                       cause):
    """``cause`` raised and left after collective 2; ``gave_up`` saw it
    first and gave up in collective 3 blaming it; ``observer``, still
    waiting in collective 3, names ``cause`` first-hand, whichever of the
    two comes first in rank order."""
    views = ranks(4)
    views[cause].leave(2, board.CLOSED_ON_EXCEPTION, "ValueError")
    views[gave_up].leave(2, board.GAVE_UP, "all_reduce #3: it left", blame=(cause,))
    with pytest.raises(PeerError, match=r"^rank %d: rank %d left after an exception after "
                                        r"collective #2 \(ValueError\) while this rank is in "
                                        r"all_reduce #3$" % (observer, cause)) as info:
        views[observer].check_peers(3, ALL_REDUCE)
    assert info.value.culprits == (cause,)
    # a wait that found the rank that gave up first (the flag waits return
    # the lowest rank gone) names the cause all the same
    with pytest.raises(PeerError, match=r"^rank %d: rank %d left after an exception "
                                        % (observer, cause)):
        views[observer].check_peers(3, ALL_REDUCE, [gave_up])
    # with only the rank that gave up to see, its blame passes on
    views = ranks(4)
    views[gave_up].leave(2, board.GAVE_UP, "all_reduce #3: it left", blame=(cause,))
    with pytest.raises(PeerError, match=r"^rank %d: rank %d gave up in collective #3 "
                                        % (observer, gave_up)) as info:
        views[observer].check_peers(3, ALL_REDUCE)
    assert info.value.culprits == (cause,)


def test_leaving_keeps_the_first_reason_and_blame():
    rank0, rank1 = two_ranks()
    rank1.leave(2, board.GAVE_UP, "first", blame=(0,))
    rank1.leave(5, board.CLOSED, "second")
    assert rank0.where(1) == "rank 1 gave up in collective #3 (first)"


def waiting(rank0, deadline):
    """Rank 0's Wait in collective 1 (an all-reduce) until ``deadline``."""
    return Wait(deadline, 1, ALL_REDUCE, rank0, 0)


def test_a_wait_for_a_word_not_yet_written_gives_up_at_the_deadline():
    """Rank 1 entered collective 1 but has not published its text, nor
    looked at the board since: rank 0's wait for it runs slice after slice
    until the deadline, then raises CollectiveTimeoutError naming rank 1,
    which stopped inside the collective."""
    rank0, rank1 = two_ranks()
    for view in (rank0, rank1):
        view.arrive(1)
    wait_s = 5 * board.SLICE_S
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError,
                       match=r"^rank 0: all_reduce #1 did not complete before its deadline: "
                             r"waiting for rank 1 \(last entered all_reduce #1 ") as info:
        rank0.wait_words(board.TEXT_SEQ, 1, waiting(rank0, start + wait_s))
    assert time.monotonic() - start >= wait_s - 1e-3 and info.value.culprits == (1,)


def test_a_wait_for_a_rank_still_waiting_names_nobody():
    """Rank 1 entered collective 1 and keeps looking at the board (it waits
    too): at the deadline rank 0's error names nobody."""
    rank0, rank1 = two_ranks()
    for view in (rank0, rank1):
        view.arrive(1)
    rank1.check_waiting(waiting(rank1, None))          # rank 1 looked just now
    with pytest.raises(CollectiveTimeoutError,
                       match=r"every rank had entered it and was still waiting in it") as info:
        rank0.wait_words(board.TEXT_SEQ, 1, waiting(rank0, time.monotonic() + board.SLICE_S))
    assert info.value.culprits == ()


def test_a_wait_ends_when_the_peer_writes_the_word():
    rank0, rank1 = two_ranks()
    rank1.words[board.STRIDE + board.TEXT_SEQ] = 1
    rank0.wait_words(board.TEXT_SEQ, 1, waiting(rank0, time.monotonic() + 5))


def test_a_peer_that_gave_up_ends_a_wait_for_its_text():
    """Rank 1 gave up (blaming rank 0) before publishing its call text for
    collective 1: rank 0's wait for that text raises PeerError passing the
    blame on, at once; nothing rank 1 wrote when leaving reads as its text
    having been published."""
    rank0, rank1 = two_ranks()
    rank1.leave(0, board.GAVE_UP, "all_reduce #1: gave up", blame=(0,))
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"^rank 0: rank 1 gave up in collective #1 "
                                        r"\(all_reduce #1: gave up\) while this rank is in "
                                        r"all_reduce #1$") as info:
        rank0.wait_words(board.TEXT_SEQ, 1, waiting(rank0, start + 5))
    assert info.value.culprits == (0,) and time.monotonic() - start < 1


def test_texts_longer_than_their_area_are_cut_and_read_back():
    """A text is cut to one byte less than its area (a NUL always ends it),
    even inside a multi-byte character, and reads back without error; the
    call text and the reason text do not overlap."""
    rank0, rank1 = two_ranks()
    long = "é" * board.TEXT_BYTES                         # two bytes each
    rank1.write_text(long)
    rank1.write_text("why", board.REASON_TEXT)
    # 447 bytes: 223 whole characters and the first byte of one more
    assert rank0.read_text(1) == "é" * ((board.TEXT_BYTES - 1) // 2) + "\ufffd" * (
        (board.TEXT_BYTES - 1) % 2)
    assert rank0.read_text(1, board.REASON_TEXT) == "why"
    rank1.write_text("x" * (2 * board.TEXT_BYTES))
    assert rank0.read_text(1) == "x" * (board.TEXT_BYTES - 1)
    assert rank0.read_text(1, board.REASON_TEXT) == "why"


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_entering_after_a_peer_entered_and_gave_up_raises_at_once(compiled, monkeypatch):
    """Rank 1 entered collective 1 with the same fingerprint, then gave up on
    it (blaming rank 0): rank 0, entering late, must not go on into an
    exchange rank 1 abandoned; it raises PeerError passing the blame on, at
    once, in the compiled wait and its Python twin alike."""
    rank0, rank1 = two_ranks()
    if not compiled:
        monkeypatch.setattr(rank0, "_ext", None)
    elif rank0._ext is None:
        pytest.skip("compiled host loops not built")
    digest = (11, 22)
    rank1.words[board.STRIDE + board.SLOT + 2:board.STRIDE + board.SLOT + 4] = (ALL_REDUCE, 0)
    rank1.words[board.STRIDE + board.SLOT + board.SLOT_WORDS:
                board.STRIDE + board.SLOT + board.SLOT_WORDS + 2] = digest
    rank1.arrive(1)
    rank1.leave(0, board.GAVE_UP, "all_reduce #1: waited for rank 0", blame=(0,))
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"^rank 0: rank 1 gave up in collective #1 ") as info:
        rank0.enter(waiting(rank0, start + 5), digest)
    assert info.value.culprits == (0,) and time.monotonic() - start < 1


def ranks_on_one_board(n):
    memory = np.zeros(n * board.LINE_BYTES, np.uint8)
    views = [board.StatusBoard(memory, r, n) for r in range(n)]
    for view in views:
        view.join()
    return views


def test_where_names_the_collective_entered_and_whether_the_rank_was_seen_waiting():
    """A rank's state in messages: the collective of the slot it entered
    (code and sequence number), and whether it looked at the board while
    waiting in it since."""
    rank0, rank1 = two_ranks()
    barrier = CODES["barrier"]
    rank1.words[board.STRIDE + board.SLOT + board.SLOT_WORDS:
                board.STRIDE + board.SLOT + 2 * board.SLOT_WORDS] = (
        7, 8, barrier, time.monotonic_ns())                  # the slot of collective 1
    rank1.arrive(1)
    assert re.fullmatch(r"rank 1 last entered barrier #1 0\.\d s ago, not seen waiting in it "
                        r"since", rank0.where(1)), rank0.where(1)
    rank1.check_waiting(Wait(None, 1, barrier, rank1, 1))
    assert re.fullmatch(r"rank 1 last entered barrier #1 0\.\d s ago, last seen waiting in it "
                        r"0\.\d s ago", rank0.where(1)), rank0.where(1)
    assert rank0.where(0) == "rank 0 has not entered any collective"


def test_giving_up_marks_the_rank_gone_in_that_collective():
    rank0, rank1 = two_ranks()
    error = rank0.give_up(3, ALL_REDUCE, CollectiveTimeoutError, "waited for rank 1", (1,))
    assert isinstance(error, CollectiveTimeoutError) and error.culprits == (1,)
    assert str(error) == "rank 0: waited for rank 1"
    assert rank1.where(0) == "rank 0 gave up in collective #3 (all_reduce #3: waited for rank 1)"


@pytest.mark.parametrize("culprit", [0, 2])
def test_closing_waits_for_every_rank_to_leave_after_the_same_collective(culprit):
    """Three ranks close after collective 4: each returns once every rank
    left after it; a rank that has not left ends the wait at its deadline,
    one that left earlier or died at once, each named (rank 0 too)."""
    views = ranks_on_one_board(3)
    for view in views:
        view.arrive(4)
        view.leave(4, board.CLOSED)
    for view in views:
        view.wait_left(4, time.monotonic() + 5)

    def others_fail(views, kind, pattern):
        for view in views:
            if view.rank == culprit:
                continue
            with pytest.raises(kind, match=pattern % view.rank) as info:
                view.wait_left(4, time.monotonic() + 0.05)
            assert info.value.culprits == (culprit,)

    views = ranks_on_one_board(3)                           # the culprit is still in #4
    for view in views:
        view.arrive(4)
        if view.rank != culprit:
            view.leave(4, board.CLOSED)
    others_fail(views, CollectiveTimeoutError,
                r"^rank %%d: closing after collective #4 timed out waiting for rank %d last "
                r"entered all_reduce #4 " % culprit)

    views = ranks_on_one_board(3)                           # the culprit left after #2
    for view in views:
        view.arrive(2 if view.rank == culprit else 4)
        view.leave(2 if view.rank == culprit else 4, board.CLOSED)
    others_fail(views, PeerError, r"^rank %%d: rank %d closed the communicator after "
                                  r"collective #2; this rank left after collective #4$" % culprit)

    views = ranks_on_one_board(3)                           # the culprit went on to #5
    for view in views:
        view.arrive(5 if view.rank == culprit else 4)
        if view.rank != culprit:
            view.leave(4, board.CLOSED)
    others = ", ".join(str(r) for r in range(3) if r != culprit)
    others_fail(views, PeerError, r"^rank %%d: this rank left after collective #4 but rank %d "
                                  r"last entered all_reduce #5 .*: uneven number of steps: rank "
                                  r"%d entered 5 collectives, ranks %s entered 4 collectives; "
                                  r"blaming rank %d \(every rank must call the same "
                                  r"collectives\)$" % (culprit, culprit, others, culprit))

    views = ranks_on_one_board(3)                           # the culprit's process ended
    pid = ended_pid()
    views[culprit].words[culprit * board.STRIDE + board.PID] = pid
    for view in views:
        view.arrive(4)
        if view.rank != culprit:
            view.leave(4, board.CLOSED)
    others_fail(views, PeerError, r"^rank %%d: rank %d \(pid %d\) died before closing$"
                % (culprit, pid))


@pytest.mark.parametrize("counts, culprits", [
    ({0: 4, 1: 4, 2: 5}, (2,)), ({0: 3, 1: 4, 2: 4, 3: 4}, (0,)), ({0: 4, 1: 5}, (0, 1)),
    ({0: 1, 1: 2, 2: 3}, (0, 1, 2)), ({0: 2, 1: 2, 2: 3, 3: 3}, (0, 1, 2, 3)),
    ({0: 6, 1: 7, 2: 6, 3: 8, 4: 6}, (1, 3))])
def test_uneven_steps_blame_the_ranks_off_the_most_common_count(counts, culprits):
    assert board.uneven_culprits(counts) == culprits


def test_steps_text_lists_the_culprits_first():
    assert board.steps_text({0: 6, 1: 7, 2: 6}, (1,), 0) == \
        "rank 1 entered 7 collectives, ranks 0, 2 entered 6 collectives; blaming rank 1"
    assert board.steps_text({0: 1, 1: 2}, (0,), 0) == \
        "rank 0 entered 1 collective, rank 1 entered 2 collectives; blaming this rank"
