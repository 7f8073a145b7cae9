"""The enqueue wing: `producer enqueue` reads an input, converts it once, accounts for every
record and puts the items a run still needs into rq jobs, exactly once across racing producers.

- core.py: enqueue_file (the checks before anything is written, then the run) and its Summary;
- runsetup.py: the run an enqueue writes into (found in Redis, re-created from its output's
  run.json, or made new);
- memplan.py: the Redis memory the run will take and where its jobs keep their items, known
  before anything is written;
- reconcile.py: what the run holds beyond its item table (the queue view, an input unchanged);
- estimate.py: the run's output tokens as the input's original answers say;
- order.py: longest first (items held back on disk, then queued from the costliest down);
- jobwriter.py: claim, pack and queue a slice of items in one transaction.

Others import the wing's modules directly (this file imports nothing, so `producer --help`
does not load rq).

May import: genqueue.common, genqueue.producer.ingest, genqueue.producer.outfiles, genqueue.producer.packitems
"""
