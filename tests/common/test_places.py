"""Items by reference have a place (issue 34, step 8): the claim writes (pack, slot) in each
item's entry, and a shipped shard's marks go to its packs' bits, a few commands a pack instead
of one an item. Against a real Redis: the places the claim and the re-claim give, the packs'
blocks at those slots, the counts and states against a model through every change (marks at
places, stale places, marks by entry, re-claims, releases, rebuild's marks), and the commands a
shard's marks cost."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis

from genqueue.common.contracts import Item
from genqueue.common.keepers.claims import Claims, Requeue, claim_key
from genqueue.common.keepers.itemlayout import PACK_SLOTS
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemCounts, ItemTable, placed
from genqueue.common.keepers.marks import Marks, Place, ShardMarks
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import job_reference, queue_for
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import key_digest
from genqueue.common.storage import store_for
from genqueue.common.storage.packreader import PackReader
from genqueue.producer.enqueue.jobwriter import JobWriter, pack_parts
from tests.common.test_items import assert_table_is, clear_failed, model_counts

RUN = "pl"


def key(i: int) -> str:
    return f"{i:032x}"


def items(n: int, start: int = 0) -> list[Item]:
    return [{"key": key(i), "index": i, "turn": None, "messages": [{"role": "user", "content": f"q{i}"}]}
            for i in range(start, start + n)]


def entry(conn: redis.Redis, d: bytes) -> int:
    return ItemTable(conn, RUN).entry(d)


def commands(conn: redis.Redis) -> int:
    return int(conn.info("stats")["total_commands_processed"])


def test_the_claim_places_what_it_wins_in_order_and_a_resend_keeps_the_places(conn: redis.Redis) -> None:
    claims = Claims(conn)
    ds = [key_digest(key(i)) for i in range(6)]
    assert claims.claim(RUN, "other", [ds[1], ds[4]]) == [True, True]  # inline: no place
    assert entry(conn, ds[1]) == IN_RUN
    assert claims.claim_slots(RUN, "a", ds[:4], pack=7) == [0, -1, 1, 2]
    assert [entry(conn, ds[i]) for i in (0, 2, 3)] == [placed(7, 0), placed(7, 1), placed(7, 2)]
    # sent again with more (a reply lost, then the whole slice): the earlier places kept, new ones after
    assert claims.claim_slots(RUN, "a", [*ds, ds[5]], pack=7) == [0, -1, 1, 2, -1, 3, -1]
    assert ItemTable(conn, RUN).counts().in_run == 6
    assert list(ItemTable(conn, RUN).states(ds)) == [IN_RUN] * 6
    assert claims.release(RUN, "a") == 4  # given back: its entries leave the table
    assert [entry(conn, ds[i]) for i in (0, 2, 3, 5)] == [0, 0, 0, 0]
    assert ItemTable(conn, RUN).counts() == ItemCounts(2, 0, 0, 0, 0)


def test_a_pack_by_reference_holds_each_item_at_the_slot_its_entry_names(conn: redis.Redis, tmp_path: Path) -> None:
    """The writer's pack: block by block, the item at ordinal first + i of the pack is the one
    whose entry says that slot; a slice longer than a pack is written as several."""
    out = tmp_path / "out"
    Claims(conn).claim(RUN, "other", [key_digest(key(i)) for i in (3, 700)])
    w = JobWriter(RUN, conn, batch_size=100, pack_store=store_for(str(out)))
    its = items(PACK_SLOTS + 300)
    won, jobs = w.write(its)
    assert won.count(False) == 2 and jobs == -(-(PACK_SLOTS - 2) // 100) + 3
    assert PackTable(conn, RUN).count() == 2
    reader = PackReader(lambda o: store_for(o))
    seen = 0
    for job in queue_for(RUN, conn).jobs:
        ref = job_reference(job.args, job.kwargs, job.meta)
        assert ref is not None
        name = PackTable(conn, RUN).name_of(ref.pack)
        assert name is not None
        got, first = reader.placed_block(str(out), RUN, name, ref.block)
        for i, it in enumerate(got):
            assert entry(conn, key_digest(it["key"])) == placed(ref.pack, first + i)
            seen += 1
    assert seen == len(its) - 2


def test_a_shards_marks_at_their_places_cost_a_few_commands_a_pack(conn: redis.Redis) -> None:
    claims, packs, marks = Claims(conn), PackTable(conn, RUN), Marks(conn, RUN)
    per = 1000  # items a pack here
    ds = [key_digest(key(i)) for i in range(2 * per)]
    for p in (1, 2):
        part = ds[(p - 1) * per:p * per]
        assert claims.claim_slots(RUN, f"c{p}", part, pack=p) == list(range(per))
        conn.hset(PackTable.key(RUN), str(p), f"w-{p:06d}")
        conn.delete(claim_key(RUN, f"c{p}"))
    assert packs.name_of(2) == "w-000002"
    sm = ShardMarks()
    for i, d in enumerate(ds):
        p, slot = divmod(i, per)
        sm.add(d.hex(), error=i % 10 == 0, kind="x", place=Place(p + 1, f"w-{p + 1:06d}", slot))
    before = commands(conn)
    marks.mark_shipped(sm)
    spent = commands(conn) - before
    # two scripts, their packs' checks, a few BITFIELDs, the counters and each script's last_mark_at
    # stamp (TIME, HSET): 30 for 2,000 items, whatever their number
    assert spent < 34, spent
    c = ItemTable(conn, RUN).counts()
    failed = len(range(0, 2 * per, 10))
    assert c == ItemCounts(2 * per, 2 * per - failed, failed, 0, 2 * per - failed)
    assert marks.progress().stats["shipped_outcome_x"] == 2 * per - failed
    # the same shard again (a resend): nothing counts twice; then the failed items' results
    marks.mark_shipped(sm)
    assert ItemTable(conn, RUN).counts() == c
    again = ShardMarks()
    for i in range(0, 2 * per, 10):
        p, slot = divmod(i, per)
        again.add(ds[i].hex(), error=False, kind="x", place=Place(p + 1, f"w-{p + 1:06d}", slot))
    marks.mark_shipped(again)
    assert ItemTable(conn, RUN).counts() == ItemCounts(2 * per, 2 * per, failed, failed, 2 * per)
    assert set(ItemTable(conn, RUN).states(ds)) == {IN_RUN | DONE, IN_RUN | DONE | FAILED}
    assert marks.done_of([key(i) for i in range(3)]) == {key(0), key(1), key(2)}


def test_a_place_the_pack_table_does_not_vouch_for_is_marked_by_its_entry(conn: redis.Redis) -> None:
    """A pack number the table lacks, or names otherwise (a rewind gave it out again), or one
    a re-claim moved items out of: the item's own entry says where its bits are."""
    claims, marks = Claims(conn), Marks(conn, RUN)
    ds = [key_digest(key(i)) for i in range(4)]
    claims.claim_slots(RUN, "c", ds, pack=3)
    conn.hset(PackTable.key(RUN), "3", "w-000003")
    conn.delete(claim_key(RUN, "c"))
    # a stranger's pack 3 (another name), and a pack 9 nobody queued: their slots are not trusted
    sm = ShardMarks()
    sm.add(ds[0].hex(), error=False, kind="x", place=Place(3, "x-000003", 2))
    sm.add(ds[1].hex(), error=False, kind="x", place=Place(9, "w-000009", 1))
    marks.mark_shipped(sm)
    assert list(ItemTable(conn, RUN).states(ds)) == [IN_RUN | DONE, IN_RUN | DONE, IN_RUN, IN_RUN]
    assert ItemTable(conn, RUN).counts() == ItemCounts(4, 2, 0, 0, 2)
    assert entry(conn, ds[0]) == placed(3, 0)  # the entry keeps its place: the bits are there
    # the items 2 and 3 moved to pack 4 by a re-claim: pack 3's slots are not trusted any more
    conn.set(RunLock.key(RUN), "tok")
    codes, slots = claims.reclaim(RUN, "r", ttl=60, token="tok", retry_failed=False, digests=ds, pack=4)
    assert codes == [Requeue.DONE, Requeue.DONE, Requeue.QUEUED, Requeue.QUEUED] and slots == [-1, -1, 0, 1]
    assert [entry(conn, d) for d in ds[2:]] == [placed(4, 0), placed(4, 1)]
    conn.hset(PackTable.key(RUN), "4", "w-000004")
    old = ShardMarks()  # the old job's shard, late: marked where the entry says now
    old.add(ds[2].hex(), error=False, kind="x", place=Place(3, "w-000003", 2))
    marks.mark_shipped(old)
    new = ShardMarks()  # then the new job's: counted once
    new.add(ds[2].hex(), error=False, kind="x", place=Place(4, "w-000004", 0))
    new.add(ds[3].hex(), error=False, kind="x", place=Place(4, "w-000004", 1))
    marks.mark_shipped(new)
    assert ItemTable(conn, RUN).counts() == ItemCounts(4, 4, 0, 0, 4)
    assert marks.progress().stats["shipped_outcome_x"] == 4


def test_counts_and_states_follow_every_change_with_places(conn: redis.Redis) -> None:
    """Random claims into packs (landed or given back), re-claims into new packs, marks at the
    current place, at a stale one, or by entry (a leftover shard, a copy, a rebuild), and direct
    changes, against a model: the counts are the model's at every step, and so is each state."""
    rng = random.Random(11)
    table, claims, marks, packs = ItemTable(conn, RUN), Claims(conn), Marks(conn, RUN), PackTable(conn, RUN)
    table.ensure(300)
    conn.set(RunLock.key(RUN), "tok")
    pool = [key_digest(key(i)) for i in range(300)]
    model: dict[bytes, int] = {}
    where: dict[bytes, Place] = {}  # each item's place as its queued job says
    stale: dict[bytes, Place] = {}
    for step in range(150):
        picked = rng.sample(pool, rng.randint(1, 40))
        op = rng.choice(["claim", "claim", "reclaim", "done", "failed", "rebuild", "clear"])
        if op in ("claim", "reclaim"):
            number = packs.allocate()
            name = f"w-{number:06d}"
            if op == "claim":
                slots = claims.claim_slots(RUN, f"c{step}", picked, pack=number, token="tok")
                for d, s in zip(picked, slots, strict=True):
                    assert (s >= 0) == (not model.get(d, 0) & IN_RUN) or picked.count(d) > 1
            else:
                _codes, slots = claims.reclaim(RUN, f"c{step}", ttl=60, token="tok", retry_failed=rng.random() < 0.5,
                                              digests=picked, pack=number)
            if op == "claim" and rng.random() < 0.3:  # given back: those it won leave the run again
                for d in conn.smembers(claim_key(RUN, f"c{step}")):
                    model[bytes(d)] = model.get(bytes(d), 0) & ~IN_RUN
                    where.pop(bytes(d), None)
                claims.release(RUN, f"c{step}")
                continue
            conn.hset(PackTable.key(RUN), str(number), name)  # the transaction that queues the jobs
            conn.delete(claim_key(RUN, f"c{step}"))
            for d, s in zip(picked, slots, strict=True):
                if s >= 0:
                    if d in where:
                        stale[d] = where[d]
                    where[d] = Place(number, name, s)
                    model[d] = model.get(d, 0) | IN_RUN
        elif op in ("done", "failed"):
            sm = ShardMarks()
            for d in picked:
                r = rng.random()
                place = where.get(d) if r < 0.7 else stale.get(d) if r < 0.85 else None
                sm.add(d.hex(), error=op == "failed", kind="x", place=place)
                model[d] = model.get(d, 0) | (DONE if op == "done" else FAILED)
            marks.mark_shipped(sm)
        elif op == "rebuild":  # marks that put items in the run too, by entry (marks._send in_run)
            sm = ShardMarks()
            for d in picked:
                sm.add(d.hex(), error=False, kind="x")
                model[d] = model.get(d, 0) | IN_RUN | DONE
            with conn.pipeline(transaction=False) as p:
                marks._send(p, sm, in_run=True)
                p.execute()
        else:
            clear_failed(table, picked, model)
        model = {d: s for d, s in model.items() if s}
        assert table.counts() == model_counts(model), (step, op)
    assert_table_is(table, model, pool)
    assert sum(1 for d in where if entry(conn, d) >= 8) > 100  # most of them by their places


def test_packs_named_again_after_their_entries_were_lost_are_marked_by_entry(conn: redis.Redis) -> None:
    """Redis lost the run, run.json named its packs again, a consumer's shard of an old job ships:
    no entry holds that place any more, so its items are marked by digest (done, not in the run
    until a rebuild or a claim puts them there), never counted as done items of the run."""
    ds = [key_digest(key(i)) for i in range(3)]
    Claims(conn).claim_slots(RUN, "c", ds, pack=5)
    conn.flushall()  # the loss
    assert PackTable(conn, RUN).put_back({5: "w-000005"}) == 1
    sm = ShardMarks()
    for i, d in enumerate(ds):
        sm.add(d.hex(), error=False, kind="x", place=Place(5, "w-000005", i))
    Marks(conn, RUN).mark_shipped(sm)
    assert ItemTable(conn, RUN).counts() == ItemCounts(0, 3, 0, 0, 0)
    assert list(ItemTable(conn, RUN).states(ds)) == [DONE] * 3


def test_a_pack_written_before_items_had_places_is_marked_by_entry(conn: redis.Redis) -> None:
    """An upgrade in the middle of a run: pack 1's items were claimed without places (plain
    entries), pack 2's with them; a shard of pack 1's job (whose consumer now knows slots) is
    marked by entry, pack 2's at its places; every state and count exact."""
    claims, marks = Claims(conn), Marks(conn, RUN)
    old = [key_digest(key(i)) for i in range(3)]
    new = [key_digest(key(i)) for i in range(3, 6)]
    claims.claim(RUN, "a", old)  # as an earlier genqueue did: no place
    claims.claim_slots(RUN, "b", new, pack=2)
    conn.hset(PackTable.key(RUN), mapping={"1": "w-000001", "2": "w-000002"})
    sm = ShardMarks()
    for i, d in enumerate(old):
        sm.add(d.hex(), error=False, kind="x", place=Place(1, "w-000001", i))
    for i, d in enumerate(new):
        sm.add(d.hex(), error=False, kind="x", place=Place(2, "w-000002", i))
    marks.mark_shipped(sm)
    assert list(ItemTable(conn, RUN).states(old + new)) == [IN_RUN | DONE] * 6
    assert [entry(conn, d) for d in old] == [IN_RUN | DONE] * 3
    assert ItemTable(conn, RUN).counts() == ItemCounts(6, 6, 0, 0, 6)


def test_a_slice_longer_than_a_pack_is_cut_where_a_record_ends() -> None:
    def rec(index: int, n: int) -> list[Item]:
        return [{"key": key(index * 100 + t), "index": index, "turn": t, "messages": []} for t in range(n)]

    its = rec(1, 3) + rec(2, 4) + rec(3, 2)
    assert [len(p) for p in pack_parts(its, 5)] == [3, 4, 2]  # never a record across two packs
    assert [len(p) for p in pack_parts(its, 7)] == [7, 2]
    assert [len(p) for p in pack_parts(rec(4, 12), 5)] == [5, 5, 2]  # longer than a pack: cut where it must
    assert [len(p) for p in pack_parts(rec(5, 1) + rec(6, 9), 5)] == [1, 5, 4]
    assert [it["key"] for p in pack_parts(its, 4) for it in p] == [it["key"] for it in its]


def test_a_job_taken_again_reads_its_items_at_their_places(conn: redis.Redis) -> None:
    """The consumer's look-up before it runs a job again: its pack's bits, a few commands for
    the job, when its pack's slots are trusted; each item's entry otherwise; the same answer."""
    claims, marks = Claims(conn), Marks(conn, RUN)
    ds = [key_digest(key(i)) for i in range(1000)]
    claims.claim_slots(RUN, "c", ds, pack=1)
    conn.hset(PackTable.key(RUN), "1", "w-000001")
    places = {key(i): Place(1, "w-000001", i) for i in range(1000)}
    sm = ShardMarks()
    for i in range(0, 1000, 3):
        sm.add(key(i), error=i % 2 == 1, kind="x", place=places[key(i)])
    marks.mark_shipped(sm)
    keys = [key(i) for i in range(1000)]
    done = {key(i) for i in range(0, 1000, 6)}
    before = commands(conn)
    assert marks.done_of(keys, places=places) == done
    assert commands(conn) - before < 20  # the script (and its load), its checks, two BITFIELDs
    assert marks.done_of(keys) == done  # by entry: the same
    assert marks.done_of(keys, places=places, first_take=True) == set()  # never rebuilt: nothing read
    ItemTable(conn, RUN).note_rebuilt()
    assert marks.done_of(keys, places=places, first_take=True) == done
    wrong = {k: Place(1, "x-000001", p.slot) for k, p in places.items()}  # a pack the table names otherwise
    before = commands(conn)
    assert marks.done_of(keys, places=wrong) == done
    assert commands(conn) - before > 1000  # read by entry


def test_a_claim_into_a_pack_of_more_items_than_it_holds_writes_nothing(conn: redis.Redis) -> None:
    ds = [key_digest(key(i)) for i in range(PACK_SLOTS + 1)]
    with pytest.raises(redis.exceptions.ResponseError, match="a pack holds"):
        Claims(conn).claim_slots(RUN, "c", ds, pack=1)
    assert ItemTable(conn, RUN).counts().in_run == 0 and not conn.exists(claim_key(RUN, "c"))
    assert Claims(conn).claim_slots(RUN, "c", ds) == [0] * len(ds)  # inline: no pack, no bound


def test_one_pack_number_under_two_names_in_a_shard_is_marked_by_entry(conn: redis.Redis) -> None:
    """Jobs from both sides of a rewind in one shard: pack 1 named w-... by the table, x-... by an
    older job. Neither name's slots are trusted for that shard: each item is marked by entry."""
    claims, marks = Claims(conn), Marks(conn, RUN)
    ds = [key_digest(key(i)) for i in range(4)]
    claims.claim_slots(RUN, "c", ds[:2], pack=1)
    claims.claim(RUN, "d", ds[2:])  # no place
    conn.hset(PackTable.key(RUN), "1", "w-000001")
    sm = ShardMarks()
    sm.add(ds[2].hex(), error=False, kind="x", place=Place(1, "x-000001", 1))  # slot 1 is ds[1]'s
    sm.add(ds[0].hex(), error=False, kind="x", place=Place(1, "w-000001", 0))
    marks.mark_shipped(sm)
    assert list(ItemTable(conn, RUN).states(ds)) == [IN_RUN | DONE, IN_RUN, IN_RUN | DONE, IN_RUN]
    assert ItemTable(conn, RUN).counts() == ItemCounts(4, 2, 0, 0, 2)
