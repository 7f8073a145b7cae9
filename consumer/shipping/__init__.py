"""The shipping wing: results on their way from an answer to the output store.

- outbox.py: per-run shard writers, sealing, and one ordered shipper that uploads a sealed
  shard, then marks its items shipped;
- shards.py: the spool on local disk: shards being written, sealed, and those a crash left;
- features.py: a --capture run's feature shards on the spool, sealed with its result shards and
  shipped before them, so a record never reaches the output before the features it names.

It knows nothing of rq, leases or the engine: the worker hands it records and learns, per
shard, when they are shipped (the acker acks on that).

May import: genqueue.common
"""
