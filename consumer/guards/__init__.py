"""The guards: what keeps a consumer honest when something goes wrong.

- stop.py: SIGTERM/SIGINT, drains and hard stops;
- supervise.py: no long-lived loop dies in silence;
- breaker.py: a failure storm pauses the run before it burns the dataset (pure policy);
- rewind.py: a Redis that went back in time costs nothing already shipped;
- ended.py: a --burst consumer's exit says how its runs ended.

May import: genqueue.common, genqueue.consumer.rqthread, genqueue.consumer.answer
"""
