"""The keepers of Redis state: every module of common/ that issues a Redis command lives here.

One module per Redis noun, and in it one class built with the connection (and the run, or the
worker, it is about) that owns the noun's keys and holds its operations, as rq keeps one
registry class per noun; a run's noun is a keeper.py RunKeeper, its key named once in its
`key_template`, as rq's registries share BaseRegistry. runs.py RunStore (a run's hash, sources,
counters), items.py ItemTable (its items; their layout and shared Lua: itemlayout.py), marks.py
Marks (done and failed marks; the marking script: markscript.py), claims.py Claims and Reclaim,
packs.py PackTable, checkpoints.py CheckpointStore, flights.py Flights, hungry.py Hungry,
pause.py Pause, runlock.py RunLock, runsources.py RunSources, snapshots.py Snapshots,
exportsets.py ExportSets, markstamps.py MarkStamp and RebuildState, spectally.py SpecTallies,
featurecounts.py FeatureCounts, captured.py CaptureBudget. rundelete.py deletes every key of a
run, genqueue's and rq's. The plumbing: redisconn.py (connections), clock.py (Redis's clock),
redismem.py (its memory), rqaccess.py, rqjobs.py and rqfailed.py (rq's own keys, read through
rq's documented surface). What issues no command stays a plain function beside its class.

The rest of common/ is pure: it issues no Redis command and imports no keeper (tests/test_layout.py).

May import: genqueue.common
"""
