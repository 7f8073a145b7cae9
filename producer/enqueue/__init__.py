"""The enqueue wing: `producer enqueue` reads an input, converts it once, accounts for every
record and puts the items a run still needs into rq jobs, exactly once across racing producers.

- core.py: enqueue_file, the entry (the checks before anything is written, then the run);
- runsetup.py / memplan.py: the run written into, and the Redis it will take and where its jobs
  keep their items (inline or packs), both settled before anything is written;
- enqueuer.py: the Enqueuer, one input's records through the phases below, a chunk at a time:
  convert.py (records to items, counted), settle.py (each item done, new, queued, failed or
  lost; longest first through order.py), slices.py (the writer threads: jobwriter.py claims,
  packs and queues a slice in one transaction);
- summary.py: each record's bucket, the counts, and the Summary `--json` prints;
- reconcile.py / unchanged.py: the queue view a re-run reads, and an input it need not read.

Others import the wing's modules directly: this file imports nothing (`producer --help` loads
no rq). Only producer/cli.py and the capture pass (prefill/command.py) import the wing.

May import: genqueue.common, genqueue.producer.ingest, genqueue.producer.outfiles, genqueue.producer.packitems
"""
