"""The dashboard wing: `consumer dashboard`, rq-dashboard made to read genqueue's queues, jobs
and workers.

    consumer dashboard                       # REDIS_URL, http://127.0.0.1:9181
    consumer dashboard --bind 0.0.0.0 --port 9181 --username ops --password ...

It runs rq-dashboard's own command line with `--json` (every option passes through; Redis from
REDIS_URL; 127.0.0.1 unless told), its worker views reading jobs with the JSON serializer. A
worker lists `current_jobs`, every job it holds, each genqueue job named by its run, items and
pack or first key (web.job_label); a job whose hash rq expired after its TTL is shown as ended;
whatever a genqueue queue holds that is no job (a pickle, garbage, a hash gone) is a row
`(malformed: <reason>)` (common/keepers/rqjobs.py's reasons), never a page that answers 500.
Why it is patched: docs/decisions.md, "rq-dashboard, patched to read genqueue".

- command.py: the click command, and rq-dashboard's argv and environment from genqueue's;
- web.py: the patches of rq-dashboard's web app (workers, held jobs, job lists and pages).

Only consumer/cli.py imports it; its registry sweeps use rqcompat's `sweep_in_redis_time`.

May import: genqueue.common, genqueue.consumer.rqcompat
"""
