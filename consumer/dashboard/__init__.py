"""The dashboard wing: `consumer dashboard`, rq-dashboard made to read genqueue's queues, jobs
and workers.

    consumer dashboard                       # REDIS_URL, http://127.0.0.1:9181
    consumer dashboard --bind 0.0.0.0 --port 9181 --username ops --password ...

rq-dashboard (0.9) out of the box fails on genqueue in three ways:

- it imports `six` without declaring it (the `dashboard` extra installs it);
- without `--json` it reads job payloads and results with pickle, and genqueue's are JSON: the
  finished-jobs and workers pages answer 500 (DeserializationError);
- even with `--json` its workers views list workers with rq's default (pickle) serializer, so
  a consumer holding jobs makes workers.json answer 500 and the Workers page shows
  "Loading..." forever (upstream `rq_dashboard/web.py`: `Worker.all(connection=...)`).

This runs rq-dashboard's own command line with `--json`, its worker listing reading jobs with
the JSON serializer, and a worker whose current job no serializer can read shown with its id
instead of failing the whole page. A consumer holds many jobs at once (rq executions), where
rq-dashboard shows one "current job" per worker: its workers data gives each worker
`current_jobs`, every job it holds, and its Workers page lists them, each genqueue job named by its
run, items and pack or first key (web.job_label), not a call string of its payload. A finished or
failed job whose hash rq expired after its TTL is shown as such (no exc_info, so no Requeue
button). And whatever a genqueue queue holds (a pickle, garbage, a
hash without data, an id whose hash is gone, a date rq does not parse), its job lists show
each such entry as a row `(malformed: <reason>)` (common/keepers/rqjobs.py's reasons), and a job's own
page and JSON say why it cannot be shown, where rq-dashboard answered 500 for the whole list. Every rq-dashboard option passes through; the Redis URL
comes from REDIS_URL as for genqueue's other commands, and it listens on 127.0.0.1 unless told.

- command.py: the click command, and rq-dashboard's argv and environment from genqueue's;
- web.py: the patches of rq-dashboard's web app (workers, held jobs, job lists and pages).

A command of its own beside the worker: only consumer/cli.py imports it. Its one touch of rq's
internals (registry sweeps in Redis's clock) is consumer/rqcompat.py's `sweep_in_redis_time`.

May import: genqueue.common, genqueue.consumer.rqcompat
"""
