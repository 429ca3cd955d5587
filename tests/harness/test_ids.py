"""Ids: unique, time-ordered, and never repeated by a forked child (they come from a buffer of
random bytes that a fork must not share)."""

from __future__ import annotations

import itertools
import os

from harness.ids import new_id

ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def test_ids_are_unique_and_ordered_by_time() -> None:
    ids = [new_id("it") for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert [i[:13] for i in ids] == sorted(i[:13] for i in ids)  # prefix + milliseconds


def value(id_: str) -> int:
    """An id's 16 characters of randomness as the number they spell."""
    return sum(ALPHABET.index(c) << (5 * (15 - n)) for n, c in enumerate(id_[-16:]))


def test_ids_made_in_one_millisecond_sort_in_the_order_they_were_made() -> None:
    ids = [new_id("it") for _ in range(20_000)]  # hundreds share a millisecond
    assert len({i[:13] for i in ids}) < len(ids)
    assert ids == sorted(ids)  # a listing's tie on one millisecond is broken by the id: newest first
    steps = {value(b) - value(a) for a, b in itertools.pairwise(ids) if a[:13] == b[:13]}
    assert len(steps) > 100  # the step is random: a neighbour cannot be guessed


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    new_id("it")  # the parent has random bytes in hand
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, " ".join(new_id("it") for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 4096).decode().split()
    os.close(read)
    parent = [new_id("it") for _ in range(3)]
    assert {c[-16:] for c in child}.isdisjoint(p[-16:] for p in parent)


def test_an_id_starts_with_its_milliseconds_so_ids_sort_by_time() -> None:
    from harness import ids

    for ms in (0, 1, 1_796_527_358_192, 2**50 - 1):
        text = ids._ms_text(ms)
        assert len(text) == 10
        assert sum(ALPHABET.index(c) << (5 * (9 - n)) for n, c in enumerate(text)) == ms
    made = [ids._ms_text(ms) for ms in (5, 1_000, 1_796_527_358_192, 1_796_527_358_193)]
    assert made == sorted(made)
