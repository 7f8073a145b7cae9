"""A consumer's look at the calls for work (common/keepers/hungry.py): read at most once a
LOOK_EVERY a run, whoever asks, and never missing a call that lives intake.HUNGRY_TTL."""

from __future__ import annotations

import time

import redis

from genqueue.common.keepers.hungry import LOOK_EVERY, Hungry, HungryLook
from genqueue.consumer.work import intake


def gets(conn: redis.Redis) -> int:
    return int(conn.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_the_look_reads_each_run_once_an_interval_and_sees_only_the_others_calls(conn: redis.Redis) -> None:
    look = HungryLook(conn, "me", every=0.3)
    Hungry(conn, "a").call("other", ttl=5.0)
    before = gets(conn)
    for _ in range(20):  # the intake's balance and the copies' look asking many times a second
        assert look.other_caller("a") == "other"
        assert look.other_caller("b") is None
    assert gets(conn) - before == 2, "one read a run in the interval"
    Hungry(conn, "a").call("me", ttl=5.0)  # this consumer calls now: not seen before the interval ends
    assert look.other_caller("a") == "other"
    time.sleep(0.35)
    assert look.other_caller("a") is None, "its own call is not another's"
    assert gets(conn) - before == 3


def test_the_interval_is_half_the_calls_life_so_none_is_missed() -> None:
    assert 2 * LOOK_EVERY <= intake.HUNGRY_TTL
