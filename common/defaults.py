"""What a user may tune: the default behind each command-line option and environment variable.

Each constant is what an option (or variable) gives when it is not set, with the reason for its
value; docs/cli.md lists the options themselves. The constants a user cannot set live beside the
code they govern, each with its reason (tests/test_layout.py holds that).
"""

from __future__ import annotations

from genqueue.common.contracts import HistoryReasoning, Mode, Truncation

# --- Redis: --redis-url / REDIS_URL; the URL's own ?socket_timeout=, ?socket_connect_timeout=
# and ?health_check_interval= override the three after it.

#: Where Redis is when neither --redis-url nor REDIS_URL is given (rq's tools read the same variable).
REDIS_URL = "redis://127.0.0.1:6379/0"
#: Seconds a command may wait for its reply: five times any pause a healthy Redis shows (a fork for
#: BGSAVE), and inside a lease's renewal period, so a dead server is an error, not a hang.
REDIS_SOCKET_TIMEOUT = 5.0
#: Seconds to open a connection: a reachable Redis accepts in milliseconds; a host dropping packets
#: would otherwise hold the caller for the kernel's SYN retries (~2 min).
REDIS_CONNECT_TIMEOUT = 5.0
#: A pooled connection idle this long (seconds) is PINGed before reuse: one a restart or a NAT closed
#: fails on the PING, before the command is sent.
REDIS_HEALTH_CHECK_INTERVAL = 30

# --- producer enqueue: the run's settings (common/settings.py) and the enqueue's options.

#: How a multi-turn conversation becomes items; regenerate makes every assistant token the target's.
MULTI_TURN = Mode.REGENERATE
#: regenerate: a turn's thinking is dropped from the history, as reasoning models' chat templates do.
HISTORY_REASONING = HistoryReasoning.DROP
#: An answer cut by max_tokens is kept and marked (its outcome says where it was cut).
TRUNCATION = Truncation.KEEP
#: Sampling: the values Qwen3-style reasoning models recommend for thinking mode.
TEMPERATURE = 0.6
#: Sampling: nucleus mass kept (Qwen3's thinking-mode value).
TOP_P = 0.95
#: Sampling: tokens an answer may take, room for a reasoning trace.
MAX_TOKENS = 4096
#: Records whose normalised text is longer than this many characters are rejected as too_long.
MAX_PROMPT_CHARS = 256 * 1024
#: A single input record larger than this is rejected without being held in memory.
MAX_RECORD_BYTES = 64 * 1024 * 1024
#: Output location when the run does not name one (--output, GENQUEUE_OUTPUT): a local directory.
OUTPUT = "./genqueue-out"
#: Answers per prompt (--samples).
SAMPLES = 1
#: --batch-size inline: small enough that a killed consumer redoes little, large enough that Redis
#: round trips per completion stay far below one.
BATCH_SIZE = 32
#: --batch-size by reference: a job costs ~600 B of Redis whatever it names, so 128 items keep a
#: queued run at ~29 B an item (docs/decisions.md, "Jobs grow with the run").
BATCH_SIZE_REFERENCE = 128
#: ... doubled for a large run up to this many items a job: rq's ~55 commands a job fall to 0.06-0.11 an item.
BATCH_SIZE_REFERENCE_MAX = 1024
#: ... while the run keeps at least this many jobs: a fleet's end of run goes with the jobs an engine gets.
JOBS_PER_RUN_MIN = 2048
#: --prompts auto queues by reference from this many items: inline costs ~1,700 B of Redis an item,
#: by reference ~100 (docs/decisions.md, "Prompts by reference, from 200,000 items").
PROMPTS_REFERENCE_FROM = 200_000

# --- consumer run and consumer launch (common/cli.py declares the options both take).

#: A consumer renews its jobs every lease/3 seconds; a lease older than this is swept back to the
#: queue, so recovery after a kill takes well under a minute (--lease).
LEASE_SECONDS = 30
#: --concurrency when it is not given: auto, steered by the engine's /metrics (running and waiting).
CONCURRENCY_OPTION = "auto"
#: Requests kept in flight with a fixed --concurrency (and with auto when the engine has no /metrics).
CONCURRENCY = 256
#: --max-concurrency: the highest in-flight limit --concurrency auto steers to, far above what an engine batches.
MAX_CONCURRENCY = 4096
#: On SIGTERM, in-flight requests get this long to finish before their jobs go back (--drain-timeout).
DRAIN_TIMEOUT = 60.0
#: Seconds to wait for one completion: a long reasoning trace can take many minutes (--request-timeout).
REQUEST_TIMEOUT = 1800.0
#: Attempts per request (--max-attempts), for a live engine's failures: waits while its /health fails spend none.
MAX_ATTEMPTS = 6
#: Seconds a starting consumer waits for its endpoint and Redis: vLLM loads a large model for minutes.
ENDPOINT_WAIT = 1800.0
#: A shard is sealed (and its jobs become ackable) at this size or age, whichever comes first.
SHARD_MAX_BYTES = 64 * 1024 * 1024
#: ... the age, in seconds: results are acked within seconds of being written.
SHARD_MAX_AGE = 10.0
#: Past this many bytes of unshipped results on local disk (the store is down), admission pauses.
SPOOL_LIMIT = 2 * 1024**3
#: Local spool directories live under this one: a consumer's is SPOOL_ROOT/gpuN (or /<port>).
SPOOL_ROOT = "./genqueue-spool"
#: The address of the metrics port (--metrics-host): every interface, as Prometheus exporters do, since
#: the Prometheus scraping a fleet runs on another host; 127.0.0.1 keeps them to this host.
METRICS_HOST = "0.0.0.0"
#: Where a host's consumers share the packs they fetched (--pack-cache, GENQUEUE_PACK_CACHE; `~` is home).
PACK_CACHE_DIR = "~/.cache/genqueue/packs"
#: Bytes of packs the cache keeps (GENQUEUE_PACK_CACHE_BYTES): ~1,000 packs of 1,024 items, a run's next
#: million items; 0 turns the cache off (a ranged GET per job).
PACK_CACHE_BYTES = 2 * 1024 ** 3
#: GPUs one engine spans (--engine-gpus, launch's --gpus-per-engine): GPU-hours count by it.
GPUS_PER_ENGINE = 1
#: vLLM's own port, GPU 0's engine: GPU N's listens on ENGINE_PORT + N (--gpu N, launch's --base-port).
ENGINE_PORT = 8000
#: Seconds between a consumer's looks at its queues when it has nothing to send (a ConsumerConfig field).
POLL_INTERVAL = 0.2
#: Seconds between a consumer's snapshots in Redis, what status and Prometheus read (a ConsumerConfig field).
TELEMETRY_INTERVAL = 2.0

# --- consumer launch

#: The engine command (vllm, or simulate for genqueue's stand-in).
ENGINE = "vllm"
#: gpu sets CUDA_VISIBLE_DEVICES for each engine; cpu leaves it (vLLM CPU builds).
DEVICE = "gpu"
#: Replicas inside one engine (data parallelism): one GPU, one engine, one consumer.
DATA_PARALLEL = 1
#: Where launch writes its engines' and consumers' logs and pids.json.
LOG_DIR = "./genqueue-logs"
#: Seconds an engine has to answer /health after it starts: a 27B model loads for minutes.
ENGINE_START_TIMEOUT = 1200.0
#: An engine failing /health this long while its process lives is hung and restarted: long enough
#: that a busy engine's slow answer is not mistaken for it.
ENGINE_HANG_TIMEOUT = 120.0

# --- producer export, check-features, status; the output store

#: `export` exits 1 past this many items failed for good (a count, or a fraction below 1): a healthy
#: run's permanent failures (prompts too long for the context) stay well under 1%.
EXPORT_MAX_FAILED = "0.01"
#: Shard bytes per partition (--partition-mb): what export's second pass holds in memory at once.
EXPORT_PARTITION_BYTES = 64 * 1024 * 1024
#: Rows `check-features` recomputes when neither --share nor --rows is given: a forward pass each.
CHECK_FEATURES_ROWS = 32
#: How far bf16 may take a token's vector from float32's, relative to its length (--tolerance): the
#: tiny model strays up to ~0.045; a wrong layer or position is 0.7 and more away.
CHECK_FEATURES_TOLERANCE = 0.1
#: Seconds between two redraws of `producer status --watch`.
STATUS_INTERVAL = 2.0
#: Open multipart uploads older than this are orphans (our object names are never resumed);
#: GENQUEUE_S3_ABORT_AFTER overrides it (seconds).
S3_STALE_UPLOAD_SECONDS = 3600.0
