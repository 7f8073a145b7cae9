"""A capture pass's input line as its item (common/prefill.py): the enqueue of a run whose
settings name a pass reads lines `{"prefill": {"row", "token_ids", "completion"}, "turn", "id"}` (what
`producer capture` writes, producer/prefill/) instead of conversations, one item each, keyed by
its row id. Everything after the conversion (claims, jobs inline or by reference, the item
table, the reconcile) is the enqueue's own.
"""

from __future__ import annotations

from genqueue.common.contracts import Item, RejectReason
from genqueue.common.prefill import prefill_key
from genqueue.producer.ingest.items import Provenance
from genqueue.producer.ingest.rejects import Rejected

#: The characters a token id takes in an item's JSON, about: the memory plan's size of a pass's item.
ID_CHARS = 6


def prefill_item(value: object, index: int, prov: Provenance) -> Item:
    """The pass's item of input line VALUE (at INDEX). Raises Rejected for a line that is none."""
    if not isinstance(value, dict):
        raise Rejected(RejectReason.NOT_OBJECT, f"a JSON {type(value).__name__}, not an object")
    pre = value.get("prefill")
    if not isinstance(pre, dict) or not isinstance(pre.get("row"), str) or not pre["row"]:
        raise Rejected(RejectReason.NO_CONVERSATION, "a capture pass's line has no prefill.row")
    ids = pre.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        raise Rejected(RejectReason.EMPTY_CONVERSATION, "a capture pass's line has no prefill.token_ids")
    completion = pre.get("completion", 0)
    if type(completion) is not int or not 0 <= completion < len(ids):
        raise Rejected(RejectReason.EMPTY_CONVERSATION, "a capture pass's line has a prefill.completion that is no "
                       "count of its generated ids")
    turn = value.get("turn")
    item: Item = {"key": prefill_key(pre["row"]), "index": index,
                  "turn": turn if type(turn) is int else None, "messages": [],
                  "prefill": {"row": pre["row"], "token_ids": ids}}
    if completion:
        item["prefill"]["completion"] = completion
    if prov.id is not None:
        item["id"] = prov.id
    if prov.source is not None:
        item["source"] = prov.source
        item["source_seq"] = prov.source_seq
    return item


def prefill_chars(item: Item) -> int:
    """The characters of a pass's ITEM's token ids in a job, about (0 for any other item)."""
    pre = item.get("prefill")
    return ID_CHARS * len(pre["token_ids"]) if pre is not None else 0
