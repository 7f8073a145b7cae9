import asyncio

from genqueue.consumer.engine.admission import Limiter, next_limit, target_waiting


def converge(slots: int, start: int, rounds: int = 40) -> int:
    """Simulate an engine with SLOTS slots fed by a client that always has work."""
    limit = start
    for _ in range(rounds):
        running = min(limit, slots)
        waiting = max(0, limit - slots)
        limit = next_limit(limit, limit, running, waiting, None, lo=8, hi=10_000)
    return limit


def test_converges_to_slots_plus_a_small_queue():
    for slots in (16, 256, 1024):
        for start in (8, 64, 5000):
            limit = converge(slots, start)
            assert slots + target_waiting(slots) <= limit <= slots + 3 * target_waiting(slots) + 2, (slots, start)


def test_does_not_grow_without_work_or_against_a_full_kv_cache():
    assert next_limit(100, 20, 20, 0, None, lo=8, hi=1000) == 100
    assert next_limit(100, 100, 90, 2, 0.995, lo=8, hi=1000) == 100
    assert next_limit(1000, 1000, 100, 0, None, lo=8, hi=1000) == 1000  # the ceiling


def test_limiter_limit_moves_while_held():
    async def go():
        lim = Limiter(2)
        await lim.acquire()
        await lim.acquire()
        third = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0.01)
        assert not third.done()
        lim.set_limit(3)
        await asyncio.wait_for(third, 1)
        lim.set_limit(1)
        lim.release()
        lim.release()
        fourth = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0.01)
        assert not fourth.done()  # 1 used, limit 1
        lim.release()
        await asyncio.wait_for(fourth, 1)

    asyncio.run(go())
