"""producer/packitems.py: the producer's readers of jobs by reference tell a pack number given
out again after a rewind by its writer's tag (real Redis, packs in a real local store)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from genqueue.common import packs
from genqueue.common.errors import JobItemsUnreadableError, UserError
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import PackRef
from genqueue.common.storage import LocalStore
from genqueue.common.storage.names import pack_tag
from genqueue.producer.packitems import PackItems, Unreadable


def put(store: LocalStore, name: str, first: int) -> None:
    w = packs.PackWriter()
    w.add_block([{"key": f"{first:032x}", "index": first, "turn": None,
                  "messages": [{"role": "user", "content": f"q{first}"}]}])
    store.put_pack("r", name, w.finish())


def test_a_number_given_out_again_is_read_again_and_a_tag_the_table_lacks_is_refused(
        conn: redis.Redis, tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    put(store, "a-000001.gqpack", 1)
    conn.hset(PackTable.key("r"), "1", "a-000001.gqpack")
    reader = PackItems(conn, "r", str(tmp_path))
    assert reader.items_of(PackRef(1, 0, pack_tag("a-000001.gqpack")))[0]["index"] == 1  # the table read, kept
    put(store, "b-000001.gqpack", 2)
    conn.hset(PackTable.key("r"), "1", "b-000001.gqpack")  # the rewound run's next enqueue
    assert reader.items_of(PackRef(1, 0, pack_tag("b-000001.gqpack")))[0]["index"] == 2
    with pytest.raises(UserError, match="pack number 1 of writer a is b-000001.gqpack"):
        reader.items_of(PackRef(1, 0, "a"))
    with pytest.raises(JobItemsUnreadableError, match="of writer a is b-000001"):
        PackItems(conn, "r", str(tmp_path), unreadable=Unreadable.NOTE).items_of(PackRef(1, 0, "a"))
