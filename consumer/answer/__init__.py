"""The answering wing: the requests of one item and the records it becomes. The worker hands it
an item and a run's context; it answers with records, whatever the endpoint did.

- generate.py: the single-turn and regenerate flows, the requests they need (their bodies from
  common/requests.py), truncation; each flow comes to a records.Ending;
- client.py: the endpoint's HTTP client (I/O only) and the Gate pausing requests while it is down;
- completion.py: reading a chat completion as every vLLM version writes it (checks, thinking);
- spec.py: an answer's speculative-decoding figures, read and summed, and what the pre-flight says of them;
- faults.py: which status or exception is which fault, retry and gate decisions, `RetryKind`;
- records.py: every record an item becomes, complete when it returns it (`record`: timings
  and the copy mark included), the one place an error record is made (pure);
- tool_turns.py: does the target's tool call match the recorded one (pure);
- checkpoints.py: a multi-turn conversation's progress, saved so a redo resumes mid-way;
- prefill.py: a capture pass's item, one prefill-only request; sinks.py: where a kept answer's
  hidden states and tables go (the capture wing's FeatureSink and TableSink).

The wing knows nothing of the queue: no rq job, lease, shard or admission; the worker's parts
(dispatch, served, copies, breaker, telemetry) stand on it, never the other way round.

May import: genqueue.common
"""
