import orjson

from consumer.shards import LocalSink, ShardWriter, leftover_shards


def test_seal_and_ship(tmp_path):
    w = ShardWriter(str(tmp_path / "spool"), "r1", "w1", max_bytes=10**9, max_age=3600)
    assert w.seal() is None
    assert w.append({"key": "a", "v": 1}) == 1
    assert w.append({"key": "b", "v": 2}) == 1
    shard = w.seal()
    assert shard is not None and shard.records == 2 and shard.keys == 2 and shard.path.exists()
    assert w.append({"key": "c"}) == 2  # a new shard after sealing
    dest = LocalSink(str(tmp_path / "out")).ship(shard)
    lines = [orjson.loads(x) for x in open(dest, "rb")]
    assert [x["key"] for x in lines] == ["a", "b"]
    man = orjson.loads((tmp_path / "out" / "r1" / "shards" / "w1-000001.manifest.json").read_bytes())
    assert man["records"] == 2 and man["sha256"] == shard.sha256


def test_due_by_size(tmp_path):
    w = ShardWriter(str(tmp_path), "r", "w", max_bytes=50, max_age=3600)
    w.append({"key": "k", "pad": "x" * 10})
    assert not w.due()
    w.append({"key": "k2", "pad": "x" * 40})
    assert w.due()


def test_leftovers_of_dead_workers_only(tmp_path):
    spool = tmp_path / "spool"
    dead = ShardWriter(str(spool), "r", "deadw", max_bytes=10**9, max_age=3600)
    dead.append({"key": "a"})
    dead._fh.write(b'{"key": "torn')  # a crash in mid-line
    dead._fh.flush()
    alive = ShardWriter(str(spool), "r", "alivew", max_bytes=10**9, max_age=3600)
    alive.append({"key": "b"})
    alive._fh.flush()
    sealed = ShardWriter(str(spool), "r", "alivew2", max_bytes=10**9, max_age=3600)
    sealed.append({"key": "c"})
    sealed.seal()
    found = leftover_shards(str(spool), lambda w: w == "deadw")
    names = sorted(s.name for s in found)
    assert names == ["alivew2-000001.jsonl", "deadw-000001.jsonl"]
    torn = [s for s in found if s.name.startswith("deadw")][0]
    assert torn.records == 1 and torn.path.read_bytes() == b'{"key":"a"}\n'
    assert (spool / "r" / "alivew-000001.jsonl.open").exists()
