"""Output lengths and text for the vLLM stand-in (consumer/sim/server.py).

Pure functions, no I/O. The text is sliced out of one pre-built buffer of short words, so
making a 512-token answer costs a string slice, not 512 random draws.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from typing import Any

import orjson

SIGMA = 1.0  # lognormal shape: heavy-tailed, like reasoning-trace lengths

# Short words (about 3.7 characters, so a token with its space is ~4.7 bytes: 512 tokens ~2.4 KB).
_WORDS = ["a", "an", "the", "of", "to", "in", "on", "at", "by", "or", "if", "so", "as", "is", "it", "be", "we", "do", "no", "up", "go", "my", "me", "us", "and", "for", "but", "not", "are", "was", "can", "has", "had", "all", "any", "one", "two", "new", "use", "way", "may", "see", "data", "time", "step", "plan", "then", "next", "when", "that", "this", "with", "from", "into", "what", "each", "case", "code", "test", "list", "node", "slot", "turn", "user", "team", "task", "idea", "fact", "rule", "path", "check", "value", "model", "token", "queue", "batch", "cache", "shard", "reply", "prompt", "answer", "result", "number", "string", "server", "client", "worker", "retry", "state", "first", "second", "third", "order", "count", "track", "split", "merge", "write", "read", "send", "wait"]
_START_POSITIONS = 8192  # distinct start offsets a request can pick


def sample_length(rng: random.Random, mean_tokens: int, cap: int | None = None) -> int:
    """One output length: lognormal (sigma SIGMA) with mean `mean_tokens`, at least 1, at most `cap`."""
    mean = max(1.0, float(mean_tokens))
    mu = math.log(mean) - SIGMA * SIGMA / 2.0
    n = max(1, int(rng.lognormvariate(mu, SIGMA) + 0.5))
    if cap is not None and n > cap:
        n = cap
    return n


def request_digest(seed: int, messages: Any, request_seed: Any = None) -> int:
    """A 64-bit value fixed by the server seed, the messages and the request's own seed."""
    h = hashlib.blake2b(orjson.dumps(messages), digest_size=8, salt=b"%d|%r" % (seed, request_seed))
    return int.from_bytes(h.digest(), "little")


class TextBuffer:
    """A long run of words; text(start, n) is n consecutive words from position `start`."""

    def __init__(self, capacity: int) -> None:
        rng = random.Random(1234)
        words: list[str] = []
        total = _START_POSITIONS + capacity + 2
        for i in range(total):
            w = rng.choice(_WORDS)
            if i % 17 == 16:
                w += "."
            words.append(w)
        starts = [0] * (total + 1)
        pos = 0
        for i, w in enumerate(words):
            starts[i] = pos
            pos += len(w) + 1
        starts[total] = pos
        self.buf = " ".join(words) + " "
        self.starts = starts
        self.capacity = capacity
        self.ids = [word_id(w) for w in words]  # one token per word (return_token_ids)

    def token_ids(self, start: int, n: int) -> list[int]:
        """The ids of text(start, n): one per word."""
        return self.ids[start : start + n] if n > 0 else []

    def text(self, start: int, n: int) -> str:
        if n <= 0:
            return ""
        s = self.starts
        return self.buf[s[start] : s[start + n] - 1]


_buffers: dict[int, TextBuffer] = {}


def text_buffer(capacity: int) -> TextBuffer:
    """A shared buffer holding at least `capacity` tokens after any start position."""
    cap = 1 << max(12, (max(1, capacity) - 1).bit_length())
    buf = _buffers.get(cap)
    if buf is None:
        buf = _buffers[cap] = TextBuffer(cap)
    return buf


#: The stand-in's vocabulary for return_token_ids: ids below WORD_IDS are the prompt's (its
#: template and text, drawn per prompt), each word of _WORDS is two ids from WORD_IDS on (with
#: and without a closing ".").
WORD_IDS = 1000


def word_id(word: str) -> int:
    """The id of one output word."""
    return WORD_IDS + 2 * _WORD_INDEX[word.rstrip(".")] + word.endswith(".")


def decode_ids(ids: list[int]) -> str:
    """The words of output ids, joined by spaces (prompt ids decode to nothing)."""
    return " ".join(_WORDS[(i - WORD_IDS) // 2] + "." * ((i - WORD_IDS) % 2) for i in ids if i >= WORD_IDS)


_WORD_INDEX = {w: i for i, w in enumerate(_WORDS)}


def prompt_token_ids(seed: int, messages: list[Any]) -> list[int]:
    """prompt_tokens(messages) ids below WORD_IDS. As a chat template renders, each message
    has its own ids (4 + its characters // 4, fixed by the seed and the message), so a longer
    history begins with a shorter one's; the count's rest comes last, as a generation prompt."""
    ids: list[int] = []
    for m in messages:
        rng = random.Random(request_digest(seed, [m]))
        ids += [rng.randrange(WORD_IDS) for _ in range(4 + _chars([m]) // 4)]
    rng = random.Random(request_digest(seed, messages))
    ids += [rng.randrange(WORD_IDS) for _ in range(prompt_tokens(messages) - len(ids))]
    return ids


def _plan(digest: int, mean_tokens: int, max_tokens: int, reasoning: str,
          think_fraction: float) -> tuple[int, int, str, int, int]:
    """(tokens, thinking tokens, finish_reason, thinking's start, answer's start) of a request."""
    rng = random.Random(digest)
    drawn = sample_length(rng, mean_tokens)
    n = min(drawn, max_tokens)
    finish = "length" if drawn >= max_tokens else "stop"
    think = 0
    if reasoning != "none" and drawn > 1:
        think = min(int(think_fraction * drawn + 0.5), drawn - 1)
    return n, think, finish, digest % _START_POSITIONS, (digest >> 20) % _START_POSITIONS


def output_token_ids(digest: int, mean_tokens: int, max_tokens: int, reasoning: str,
                     think_fraction: float) -> list[int]:
    """The ids of make_output's words (as many as its completion_tokens): the thinking's, then
    the answer's; decode_ids gives the words back."""
    n, think, finish, start1, start2 = _plan(digest, mean_tokens, max_tokens, reasoning, think_fraction)
    buf = text_buffer(n)
    if n <= think and finish == "length":
        return buf.token_ids(start1, n)
    return buf.token_ids(start1, think) + buf.token_ids(start2, n - think)


def make_output(
    digest: int,
    mean_tokens: int,
    max_tokens: int,
    reasoning: str,
    think_fraction: float,
) -> tuple[str, str | None, int, str]:
    """(content, reasoning_text, completion_tokens, finish_reason) for one request.

    The same digest always gives the same natural length and words; a smaller max_tokens cuts
    a prefix of them. finish_reason is "length" when the natural length reaches max_tokens.
    With reasoning "field" or "reasoning_content" the thinking goes to reasoning_text; "inline"
    puts "<think>...</think>" in front of the content; "none" has no thinking.
    """
    n, think, finish, start1, start2 = _plan(digest, mean_tokens, max_tokens, reasoning, think_fraction)
    buf = text_buffer(n)
    if n <= think and finish == "length":  # the budget ran out inside the thinking
        cut = buf.text(start1, n)
        if reasoning == "inline":
            return "<think>\n" + cut, None, n, finish
        return "", cut, n, finish
    thought = buf.text(start1, think) if think else None
    answer = buf.text(start2, n - think)
    if reasoning == "inline":
        return "<think>\n" + (thought or "") + "\n</think>\n\n" + answer, None, n, finish
    return answer, thought, n, finish


def prompt_tokens(messages: list[Any]) -> int:
    """vLLM-ish estimate: characters of all message text // 4, plus 4 per message."""
    return _chars(messages) // 4 + 4 * len(messages)


def _chars(messages: list[Any]) -> int:
    chars = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    return chars


_HINT = re.compile(r"\[len=(\d+)\]")


def hinted_mean(messages: list[Any], default: int) -> int:
    """With --length-hints, the model's answer length follows the dataset's original answer:
    a "[len=N]" in the last user message makes N the mean of the drawn length (a stand-in for
    "the target answers about as long as the original did", for longest-first benchmarks)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            found = _HINT.search(m["content"])
            return max(1, int(found.group(1))) if found else default
    return default



TOOL_CALL_MODES = ("none", "recorded", "diverge")
_CALL_HINT = "[call="


def call_hints(text: str) -> list[list[tuple[str, Any]]]:
    """The rounds of tool calls a user message asks for: each "[call=NAME:JSON,NAME:JSON]" is
    one round (several calls: parallel ones), in order. A hint that does not parse is ignored."""
    rounds: list[list[tuple[str, Any]]] = []
    dec = json.JSONDecoder()
    at = text.find(_CALL_HINT)
    while at >= 0:
        pos = at + len(_CALL_HINT)
        calls: list[tuple[str, Any]] = []
        try:
            while True:
                colon = text.index(":", pos)
                name = text[pos:colon].strip()
                args, pos = dec.raw_decode(text, colon + 1)
                calls.append((name, args))
                if text.startswith(",", pos):
                    pos += 1
                    continue
                if text.startswith("]", pos) and name:
                    rounds.append(calls)
                break
        except ValueError:  # json.JSONDecodeError is one
            pass
        at = text.find(_CALL_HINT, pos)
    return rounds


def tool_calls_for(messages: list[Any], mode: str, digest: int) -> list[dict[str, Any]] | None:
    """With --tool-calls recorded|diverge, the calls this request answers with, or None for a
    text answer. The last user message's hints name the rounds; the assistant messages with
    tool calls since it say how many rounds were made. `recorded` makes the hinted calls,
    `diverge` the hinted names with other arguments. Ids are vLLM-like, fixed by the digest."""
    if mode == "none":
        return None
    made = 0
    for m in reversed(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "user":
            text = m.get("content")
            rounds = call_hints(text) if isinstance(text, str) else []
            if made >= len(rounds):
                return None
            out = []
            for i, (name, args) in enumerate(rounds[made]):
                if mode == "diverge":
                    args = {"diverged": True}
                out.append({"id": f"chatcmpl-tool-{digest:016x}{i}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}})
            return out
        if m.get("role") == "assistant" and m.get("tool_calls"):
            made += 1
    return None
