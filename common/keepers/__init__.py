"""The keepers of Redis state: every module of common/ that issues a Redis command lives here.

One module per Redis noun, and in it one class that is built with the connection (and the run,
or the worker, it is about), owns the noun's keys and holds its operations, as rq keeps one
registry class per noun; a run's noun is a keeper.py RunKeeper, its key named once in its
`key_template`, as rq's registries share BaseRegistry: runs.py RunStore (a run's hash, sources and counters; its items: items.py ItemTable),
marks.py Marks (done and failed marks, their counters and Lua), claims.py Claims (a producer's
claim sets: their keys and every write to them), checkpoints.py CheckpointStore, flights.py
Flights, hungry.py Hungry, pause.py Pause, runlock.py RunLock, runsources.py RunSources,
snapshots.py Snapshots, exportsets.py ExportSets and ScratchSet, markstamps.py MarkStamp and
RebuildState, spectally.py SpecTallies (a run's acceptance tallies), captured.py CaptureBudget (a
--capture run's bytes captured, against its budget; and capture_figures, what every screen shows of
a capture). What issues no command (a record's kind, a key's digest, a snapshot's reading) stays a
plain function beside its class.
rundelete.py deletes every key of a run, genqueue's and rq's. And the Redis plumbing they stand
on: redisconn.py (every connection), clock.py (Redis's clock), redismem.py (its memory),
rqaccess.py and rqjobs.py (rq's own keys, read through rq's documented surface).

The rest of common/ is pure: contracts, settings, conversions and rules that issue no Redis
command and import no keeper (tests/test_layout.py holds both sides).

May import: genqueue.common
"""
