"""Quality gates at export: which of a record's generated answers a trainer should not see.

Pure, no I/O. `record_flags` reads one success record and returns the reasons it is flagged
(a bitmask of FlagReason bits, so the partition header carries it in one byte) and the
digest of its generated text, which pass 2 checks for exact duplicates across items
(`Duplicates`). Only what the target generated is gated: the final answer, or in mode
regenerate every generated turn; the input's own history answers are not.

- thinking_marker: the answer's content holds a thinking tag (`<think>`, `</think>`,
  `<thinking>`, `<reasoning>`, Seed's `<seed:think>`, gpt-oss's `<|channel|>`): a reasoning
  parser that missed, and a trainer that would learn to write the tag as text.
- empty_answer: the content is blank and the answer called no tool.
- repetition_loop: the content or the thinking ends in a loop (REPETITION_SCALES): its last
  `span` characters repeat one unit of at most `span // MIN_REPEATS` characters, so the unit
  is seen at least MIN_REPEATS times back to back, up to the end. Random prose never does;
  a model stuck in "I think I think ..." or repeating a paragraph until max_tokens does.
- duplicate_answer: another item, earlier in the dataset's order, has the same generated
  text (content and thinking, every generated turn), byte for byte.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator
from enum import StrEnum

from genqueue.common.records import ResultRecord


class FlagReason(StrEnum):
    """Why an exported answer is flagged (one bit each in a flags byte, in this order)."""

    THINKING_MARKER = "thinking_marker"
    EMPTY_ANSWER = "empty_answer"
    REPETITION_LOOP = "repetition_loop"
    DUPLICATE_ANSWER = "duplicate_answer"
    #: --only-target-turns: the conversation holds assistant turns the target did not write.
    ORIGINAL_TURNS = "original_turns"


REASONS = tuple(FlagReason)
BIT = {reason: 1 << i for i, reason in enumerate(REASONS)}

_MARKER = re.compile(r"</?(?:think|thinking|reasoning|seed:think)>|<\|channel\|>", re.IGNORECASE)

#: A repetition: a tail made of one unit seen at least this many times.
MIN_REPEATS = 4
#: (span, longest unit): short loops ("the the the", "!!!!") over 256 characters, sentence or paragraph loops over 2048.
REPETITION_SCALES = ((256, 256 // MIN_REPEATS), (2048, 2048 // MIN_REPEATS))
#: Characters of an answer's end looked for earlier in it first: 16 rarely repeat by chance, so most skip the check.
_CUE = 16


def reasons(flags: int) -> list[str]:
    """The reasons set in FLAGS, in FlagReason order."""
    return [r.value for r in REASONS if flags & BIT[r]]


def has_thinking_marker(content: str) -> bool:
    return "<" in content and _MARKER.search(content) is not None


def is_empty(content: str, tool_calls: object) -> bool:
    return not content.strip() and not tool_calls


def loop_period(text: str) -> int:
    """The length of the unit TEXT's tail repeats (REPETITION_SCALES), 0 when it ends in no loop."""
    n = len(text)
    for span, longest in REPETITION_SCALES:
        if n < span:
            return 0
        # A cheap necessary condition first: with a period p <= LONGEST, the last _CUE
        # characters occur again p characters earlier. Ordinary text mostly fails it here.
        if text.find(text[-_CUE:], n - _CUE - longest, n - 1) < 0:
            continue
        tail = text[-span:]
        probe = tail[:span - longest]
        # t has period p <= LONGEST iff t[p:] == t[:-p]; then PROBE (t's head) occurs at p.
        p = tail.find(probe, 1, longest + len(probe))
        while p != -1:
            if tail[p:] == tail[:-p]:
                return p
            p = tail.find(probe, p + 1, longest + len(probe))
    return 0


def _answers(rec: ResultRecord) -> Iterator[tuple[str, str | None, object]]:
    """(content, thinking, tool calls) of every answer the target generated in REC."""
    turns = rec.get("turns")
    if isinstance(turns, list) and turns:
        for t in turns:
            yield t.get("content") or "", t.get("reasoning"), t.get("tool_calls")
        return
    yield rec.get("content") or "", rec.get("reasoning"), rec.get("tool_calls")


def record_flags(rec: ResultRecord) -> tuple[int, int]:
    """(the flags bitmask of REC's own gates, the 8-byte digest of its generated text as an
    int, 0 when it has none to compare: an answer with no text is not a duplicate of another)."""
    flags = 0
    parts: list[str | None] = []
    text = False
    for content, thinking, calls in _answers(rec):
        if is_empty(content, calls):
            flags |= BIT[FlagReason.EMPTY_ANSWER]
        if has_thinking_marker(content):
            flags |= BIT[FlagReason.THINKING_MARKER]
        if loop_period(content) or (thinking and loop_period(thinking)):
            flags |= BIT[FlagReason.REPETITION_LOOP]
        parts += (thinking, content)
        text = text or bool(content.strip() or (thinking or "").strip())
    if not text:
        return flags, 0
    # Python's own 64-bit hash of the strings (SipHash, computed in C, no copy): the digests
    # are compared within one export process only. 0 marks "none": a digest that happens to
    # be 0 is moved to 1 (one value in 2**64).
    return flags, hash(tuple(parts)) & 0xFFFF_FFFF_FFFF_FFFF or 1


class Duplicates:
    """Exact duplicates among the answers of the dataset, in its order: the first of a text is
    kept, every later one is a duplicate. The digests seen are held in one open-addressing
    table of 8-byte slots (an array, half full at most): 16 to 32 bytes per distinct answer,
    16-32 MB per million, whatever the partitions. Two different texts share a digest with
    odds about n**2 / 2**65 (1 in 30 million at 1M answers)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._table = array("Q", bytes(8 * capacity))
        self._mask = capacity - 1
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, digest: int) -> bool:
        """Add DIGEST (not 0); False when it was there already."""
        table, mask = self._table, self._mask
        i = digest & mask  # the digest is a hash: its low bits are as good as any
        while True:
            v = table[i]
            if v == digest:
                return False
            if not v:
                table[i] = digest
                self._n += 1
                if 2 * self._n > mask:
                    self._grow()
                return True
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = self._table
        self._table = array("Q", bytes(16 * len(old)))
        self._mask = 2 * len(old) - 1
        self._n = 0
        for v in old:
            if v:
                self.add(v)

    def check(self, digests: list[int]) -> list[bool]:
        """For each of DIGESTS (0: none), in order: whether an earlier one had it."""
        add = self.add
        return [bool(d) and not add(d) for d in digests]
