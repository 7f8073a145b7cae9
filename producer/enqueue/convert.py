"""Convert and count: each input record made into its items once, and what the conversion meets
counted in the enqueue's Tally: the rejects (by reason, and in the rejects file), the user turns
and the items cut at a tool turn (the multi-turn rule's input, shown by `producer status`), and
the characters of the original answers the items regenerate (the run's token estimate).

A record of a capture pass is one item as it stands (ingest/prefill.py); any other is a
conversation, refused past the run's max_prompt_chars, cut into items by its multi-turn rule.
With longest-first ordering, each item's cost is kept by its key (`estimates`) until the chunk
it is in is settled.
"""

from __future__ import annotations

from genqueue.common.contracts import Item, RejectReason
from genqueue.common.estimate import output_chars
from genqueue.common.settings import RunSettings
from genqueue.producer.enqueue.summary import Tally
from genqueue.producer.ingest.conversation import Conversation
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import STOPPED_AT_TOOL_TURN, Origin, answer_lengths, estimate_cost, make_items
from genqueue.producer.ingest.prefill import prefill_item
from genqueue.producer.ingest.reader import RawRecord
from genqueue.producer.ingest.rejects import Rejected, RejectsWriter


class Converter:
    """Records to items for one enqueue, counted in TALLY. COSTS: keep each item's cost."""

    def __init__(self, settings: RunSettings, tally: Tally, *, origin: Origin, rejects: RejectsWriter | None,
                 costs: bool) -> None:
        self.settings = settings
        self.tally = tally
        self.origin = origin
        self.rejects = rejects
        self.costs = costs
        #: the cost of each item converted since the last settle, by its key (longest first)
        self.estimates: dict[str, int] = {}

    def convert(self, rec: RawRecord) -> list[Item] | None:
        """REC's items; None when it is rejected (counted, and written to the rejects file)."""
        if rec.error is not None:
            self._reject(rec, rec.error)
            return None
        try:
            if self.settings.prefill is not None:  # a capture pass: its lines are rows (ingest/prefill.py)
                return [prefill_item(rec.value, rec.index, self.origin.of(rec.value))]
            conv = normalize(rec.value)
            chars = conv.text_chars()
            if chars > self.settings.max_prompt_chars:
                raise Rejected(RejectReason.TOO_LONG, f"{chars} characters > limit {self.settings.max_prompt_chars}")
            items = make_items(conv, self.settings.multi_turn, rec.index, self.origin.of(rec.value))
            self._count_turns(conv, items)
            answers = answer_lengths(conv)
            self._count_answers(items, answers)
            if self.costs:
                self.estimates.update((it["key"], estimate_cost(it, answers)) for it in items)
            return items
        except Rejected as r:
            self._reject(rec, r.reason, r.detail)
            return None

    def _reject(self, rec: RawRecord, reason: RejectReason, detail: str = "") -> None:
        self.tally.reasons[reason] += 1
        if self.rejects is not None:
            self.rejects.write(rec.index, rec.line, rec.snippet, reason, detail)

    def _count_turns(self, conv: Conversation, items: list[Item]) -> None:
        """What the multi-turn rule meets: records with several user turns, and the items cut
        at a tool turn (`producer status` shows them beside what the consumers generated)."""
        counts = self.tally.counts
        users = sum(m["role"] == "user" for m in conv.messages)
        counts["user_turns"] += users
        counts["multi_turn_records"] += users > 1
        counts["stopped_at_tool_turn"] += sum(it.get("note") == STOPPED_AT_TOOL_TURN for it in items)

    def _count_answers(self, items: list[Item], answers: list[int]) -> None:
        counts = self.tally.counts
        for it in items:
            chars = output_chars(it, answers)
            counts["output_items"] += 1
            counts["output_answered"] += chars > 0
            counts["output_chars"] += chars
