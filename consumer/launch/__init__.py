"""The node launcher wing: `consumer launch` starts one vLLM engine and one consumer per GPU on a
node, waits for each engine's health, and supervises the pairs (restart with backoff, stop the
node as one on SIGTERM).

- command.py: the click command and its options;
- plan.py: the pure plan (which GPUs, ports, engine argv, consumer argv) from the options;
- children.py: one child process (spawn, health probe, last log line);
- supervisor.py: the loop that keeps every pair up and reports why one gave up.

The launcher only starts processes: it never touches Redis or the worker's code, it runs
`consumer run` as a child like a user would.

May import: genqueue.common
"""
