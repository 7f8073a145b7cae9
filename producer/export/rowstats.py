"""What the rows of an exported dataset hold, counted in one pass: the one count every figure of
what an export wrote comes from. The export counts the rows as its sink writes them (after
dedupe, the quality gates and selection by acceptance: sinks.CountingSink), and its summary
(`rows`, `exported`, the traces kept, `by_variant`) and its card (tables and pictures) read
that one RowStats; read_rows + row_stats count a file already written the same way.

Token lengths are per generation, from the answer's own `usage`; a row holding several answers
(a conversation row) carries their summed usage, counted apart (card.py says how the card shows
them).
"""

from __future__ import annotations

import array
import gzip
import io
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import orjson

from genqueue.producer.export.formats.sharegpt import THINK_CLOSE, THINK_OPEN

__all__ = ["RowStats", "read_rows", "row_stats"]

#: Rows per Parquet batch in the card's pass (bounded memory).
PARQUET_BATCH = 4096


def _ints() -> array.array[int]:
    return array.array("q")


@dataclass
class RowStats:
    """What one pass over the exported rows found."""

    rows: int = 0  # lines of the dataset file
    entries: int = 0  # the format's rows (a --group-samples line holds several)
    conversations: int = 0  # distinct item keys (consecutive rows of one key are one item)
    generations: int = 0
    traces: int = 0  # thinking traces the rows hold where a Qwen3-style template renders them (_traces)
    variants: Counter[str] = field(default_factory=Counter)  # conversations by their request variant
    gens_per_conversation: Counter[int] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    fingerprints: Counter[str] = field(default_factory=Counter)
    prompt: array.array[int] = field(default_factory=_ints)  # per generation
    completion: array.array[int] = field(default_factory=_ints)  # thinking + answer, per generation
    thinking: array.array[int] = field(default_factory=_ints)  # where reasoning_tokens was reported
    answer: array.array[int] = field(default_factory=_ints)  # completion - thinking, where both known
    no_usage: int = 0  # generations whose row carries no usage counts
    summed_rows: int = 0  # rows holding several answers: their usage is the answers' sum
    summed_generations: int = 0
    summed_completion: array.array[int] = field(default_factory=_ints)  # per such row
    _key: object = None
    _key_gens: int = 0

    def add(self, row: Mapping[str, Any]) -> None:
        """Count one exported row (a --group-samples line: each of its samples)."""
        self.rows += 1
        samples = row.get("samples")
        for one in samples if isinstance(samples, list) else [row]:
            if isinstance(one, Mapping):
                self._add(one)

    def add_lines(self, lines: bytes | memoryview) -> None:
        """Count each JSON line of LINES (what a sink is handed: one or more rows)."""
        for line in bytes(lines).splitlines():
            if line.strip():
                self.add(orjson.loads(line))

    def _add(self, row: Mapping[str, Any]) -> None:
        self.entries += 1
        key = row.get("key")
        if key != self._key or key is None:
            self._close_key()
            self._key = key
            self.conversations += 1
            variant = row.get("variant")
            if isinstance(variant, str):
                self.variants[variant] += 1
        self.traces += _traces(row)
        usage, n, one_row_per_generation = _usage(row), *_answers(row)
        if one_row_per_generation:
            self._key_gens += 1
        else:
            self._key_gens = max(self._key_gens, n)
        for name, counter in (("source", self.sources), ("model", self.models), ("fingerprint", self.fingerprints),
                              ("outcome", self.outcomes)):
            value = row.get(name)
            if isinstance(value, str):
                counter[value] += 1
        prompt, completion, thinking = (_count(usage, k) for k in ("prompt_tokens", "completion_tokens",
                                                                    "reasoning_tokens"))
        if n > 1:
            self.summed_rows += 1
            self.summed_generations += n
            self.generations += n
            if completion is not None:
                self.summed_completion.append(completion)
            return
        if n == 0:
            return
        self.generations += 1
        if prompt is None and completion is None:
            self.no_usage += 1
        if prompt is not None:
            self.prompt.append(prompt)
        if completion is not None:
            self.completion.append(completion)
        if thinking is not None:
            self.thinking.append(thinking)
            if completion is not None:
                self.answer.append(completion - thinking)

    def _close_key(self) -> None:
        if self._key is not None or self._key_gens:
            self.gens_per_conversation[self._key_gens] += 1
        self._key_gens = 0

    def done(self) -> RowStats:
        self._close_key()
        self._key = None
        return self


def _count(usage: Mapping[str, Any], name: str) -> int | None:
    value = usage.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usage(row: Mapping[str, Any]) -> Mapping[str, Any]:
    usage = row.get("usage")
    if usage is None:  # a Batch line: the body's
        response = row.get("response")
        body = response.get("body") if isinstance(response, dict) else None
        usage = body.get("usage") if isinstance(body, dict) else None
    return usage if isinstance(usage, dict) else {}


def _answers(row: Mapping[str, Any]) -> tuple[int, bool]:
    """(how many generated answers ROW's usage covers, whether the row is one generation of
    several rows per conversation). A row of one generation (--format tokens, a Batch line, a
    row that names its `generation`) is one; a conversation row: its turns the target wrote."""
    if "loss_mask" in row or "response" in row or isinstance(row.get("generation"), int):
        return 1, "loss_mask" in row or isinstance(row.get("generation"), int)
    targets = row.get("target_turns")  # sharegpt
    if isinstance(targets, list):
        return len(targets), False
    turns = row.get("messages")
    if not isinstance(turns, list):
        turns = row.get("conversations")
    if isinstance(turns, list):
        return sum(1 for t in turns if isinstance(t, dict) and t.get("role") == "assistant"
                   and t.get("generated_by_target") is not False), False
    return 0, False


# --- reading the exported file ----------------------------------------------------------------
def read_rows(path: Path, *, parquet: bool) -> Iterator[dict[str, Any]]:
    """The rows of an exported dataset file, one at a time (JSONL, .gz, .zst, or Parquet)."""
    if parquet:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH):
            yield from batch.to_pylist()
        return
    with _open(path) as fh:
        for line in fh:
            if line.strip():
                yield orjson.loads(line)


def _open(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _traces(row: Mapping[str, Any]) -> int:
    """The thinking traces of ROW's generated answers that a Qwen3-style template renders: a
    generation row's answer's (its last turn), a conversation row's answers after its last user
    turn (genrows.py says why); a trace is thinking text that is not blank. None in a row of
    token ids or a Batch line."""
    turns = row.get("messages")
    if not isinstance(turns, list):
        turns = row.get("conversations")
    if not isinstance(turns, list):
        return 0
    targets = row.get("target_turns")  # sharegpt: the target's turns by index
    if isinstance(targets, list):
        answers = [i for i in targets if isinstance(i, int) and 0 <= i < len(turns)]
    else:
        answers = [i for i, t in enumerate(turns) if isinstance(t, Mapping) and t.get("role") == "assistant"
                   and t.get("generated_by_target") is not False]
    if isinstance(row.get("generation"), int):
        answers = answers[-1:]
    else:
        last_user = max((i for i, t in enumerate(turns) if isinstance(t, Mapping)
                         and t.get("role", t.get("from")) in ("user", "human")), default=-1)
        answers = [i for i in answers if i > last_user]
    return sum(_thought(turns[i]) for i in answers)


def _thought(turn: Mapping[str, Any]) -> bool:
    """TURN holds thinking: its `reasoning_content`, or (sharegpt) a value that opens with the
    thought words sharegpt.thinking_text writes."""
    reasoning = turn.get("reasoning_content")
    if reasoning is None:
        value = turn.get("value")
        if not (isinstance(value, str) and value.startswith(THINK_OPEN)):
            return False
        reasoning = value[len(THINK_OPEN):].split(THINK_CLOSE, 1)[0]
    return isinstance(reasoning, str) and bool(reasoning.strip())


def row_stats(rows: Iterable[Mapping[str, Any]]) -> RowStats:
    stats = RowStats()
    for row in rows:
        stats.add(row)
    return stats.done()
