"""The keepers of Redis state: every module of common/ that issues a Redis command lives here.

One module per Redis noun, its keys and its operations (as rq keeps one registry per noun):
runs.py (a run's hash and counters), marks.py (done and shipped marks), claims.py (a
producer's claim sets: their keys and every write to them), checkpoints.py, flights.py,
hungry.py, pause.py, runlock.py, runsources.py, snapshots.py, exportsets.py, markstamps.py, rundelete.py, spectally.py (a run's acceptance tallies); and the Redis plumbing they stand on:
redisconn.py (every connection), clock.py (Redis's clock), redismem.py (its memory),
rqaccess.py and rqjobs.py (rq's own keys, read through rq's documented surface).

The rest of common/ is pure: contracts, settings, conversions and rules that issue no Redis
command and import no keeper (tests/test_layout.py holds both sides).

May import: genqueue.common
"""
