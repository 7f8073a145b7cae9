"""The engine watch: what the local vLLM says of itself, what binds it, and how much to send it.

- readings.py: the engine's own /metrics, parsed (pure);
- doctor.py: from a window of readings and the consumer's own view, what binds the engine now
  and what to change (pure policy);
- speculation.py: whether speculative decoding pays at the engine's load (pure policy);
- admission.py: the in-flight limit and the policy that moves it by the engine's signals
  (`--concurrency auto`).

May import: genqueue.common
"""
