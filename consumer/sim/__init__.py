"""The stand-in engine wing: `consumer simulate` serves vLLM's OpenAI API (chat completions,
streaming, completions, /metrics, /health, /v1/models) on CPU with deterministic text, so the demo, the tests
and the benchmarks exercise the real consumer over real HTTP without a GPU.

- server.py: the click command, SimConfig and SimServer (the process users start);
- app.py: the aiohttp routes; completions.py: /v1/completions, as a capture pass uses it;
- engine.py: the slot engine (admission, batching, faults on demand) and timed generation;
- kv.py: a KV cache in tokens that preempts past it, a prefix cache, speculation's yield a step;
- spec.py: one request's speculative decoding, its verify steps;
- text.py: deterministic output text, lengths, tool calls and token counts;
- capture.py: hidden states saved as vLLM's KV connector saves them; logprobs.py: top-K tables.

The stand-in stands alone: it knows nothing of genqueue's queue or records, only the wire format
a real vLLM speaks, so nothing it does can leak into what the consumer believes about an engine.
One exception, and why: its hidden states are common/features/standin.py's deterministic
function, shared with the tests that check a captured row (a pure function of token id,
position and layer, with no state and nothing of genqueue's queue or records in it).

May import: genqueue.common.features.standin
"""
