"""What an answer leaves for a drafter's trainer: the target's hidden states (--capture) and the
teacher's log-probability tables (--logprobs).

- connector/: the KV connector vLLM loads by module path (runs inside vLLM's own interpreter,
  so it imports only the standard library, torch and vLLM);
- engine_args.py: the engine flags and environment that turn capture on, and the request field
  that keeps the generated tokens' hidden states too;
- captured.py: one captured file read back (safetensors parsed here; no torch needed);
- features.py: an answer's capture checked against its token ids and kept as a feature row;
- tables.py: an answer's log-probability tables parsed, checked and kept as a feature row;
- probe.py: the pre-flight's capture probe judged (the engine captures the run's layers);
- facts.py: what is known of the engine a capture was made by, for its manifest;
- owner.py: whose capture file is whose on the engine's disk (a request id naming the spool), and
  a dead predecessor's files removed.

May import: genqueue.common, genqueue.consumer.answer.faults
"""
