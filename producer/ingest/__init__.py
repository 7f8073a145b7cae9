"""The input wing: from a user's files to the items a run enqueues.

- streams.py / splitter.py / reader.py: open plain, gzip and zstd files (local or S3), split
  JSON lines and JSON arrays, and yield one raw record with its source position;
- inputcheck.py: refuse CSV, binary and empty input before a run exists;
- conversation.py / convert.py: the multi-turn rule (regenerate, last, each, first) that turns a
  ShareGPT or OpenAI conversation into prompts, and the reasons a record is rejected;
- items.py: the work items a conversation is cut into, and the keys that name them;
- rejects.py: the rejects file (every refused line, its reason);
- sources.py: the order of a run's input files (each gets its place the first time it is enqueued);
- prefill.py: a capture pass's input line (what `producer capture` writes) as its item.

The wing reads and converts; it never writes to Redis (the enqueue wing does that with what
it yields).

May import: genqueue.common, genqueue.producer.outfiles
"""
