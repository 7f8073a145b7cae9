"""Every default in one place, each with the reason for its value."""

from __future__ import annotations

#: Redis URL when neither --redis-url nor REDIS_URL is given (rq's tools read the same variable).
REDIS_URL = "redis://127.0.0.1:6379/0"

#: Items per rq job. Small enough that a killed consumer re-does little, large enough that
#: Redis round trips per completion stay far below one.
BATCH_SIZE = 32

#: How a multi-turn conversation becomes items; regenerate makes every assistant token the target's.
MULTI_TURN = "regenerate"

#: Sampling defaults: the values Qwen3-style reasoning models recommend for thinking mode.
TEMPERATURE = 0.6
TOP_P = 0.95
MAX_TOKENS = 4096

#: Records whose normalised text is longer than this many characters are rejected as too_long.
MAX_PROMPT_CHARS = 256 * 1024

#: A single input record larger than this is rejected without being held in memory.
MAX_RECORD_BYTES = 64 * 1024 * 1024

#: Output location when the run does not name one (a local directory, for one machine).
OUTPUT = "./genqueue-out"

#: Retry budget of a job: how many times an abandoned or failed job goes back to the queue.
JOB_RETRIES = 3

#: How long rq keeps a finished job (and its small manifest) before it expires.
RESULT_TTL = 24 * 3600

#: Prefix of every Redis key genqueue owns (rq's own keys keep rq's prefix).
KEY_PREFIX = "genqueue"

#: Leases: a consumer renews its jobs every LEASE/3 seconds; a lease older than this is
#: abandoned and swept back to the queue, so recovery after a kill takes well under a minute.
LEASE_SECONDS = 30

#: Requests a consumer keeps in flight with a fixed --concurrency (and with auto when the
#: engine has no /metrics).
CONCURRENCY = 256

#: --concurrency auto: where it starts, and the bounds it moves within.
AUTO_START = 256
#: How often --concurrency auto reads the engine's /metrics.
AUTO_INTERVAL = 0.5
AUTO_MIN = 8
MAX_CONCURRENCY = 4096

#: A shard is sealed (and its jobs become ackable) at this size or age, whichever comes first.
SHARD_MAX_BYTES = 64 * 1024 * 1024
SHARD_MAX_AGE = 10.0

#: On SIGTERM, in-flight requests get this long to finish before their jobs go back to the queue.
DRAIN_TIMEOUT = 60.0

#: Past this many bytes of unshipped results on local disk (the store is down), a consumer
#: pauses admission: it keeps its leases and waits for shards to ship.
SPOOL_LIMIT = 2 * 1024**3
