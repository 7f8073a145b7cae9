"""`--format tokens`: one row per generated answer, in the pre-tokenized form vllm-project/
speculators' training reads as it is (src/speculators/data_generation/preprocessing.py,
`_passthrough_pretokenized`: `input_ids` and `loss_mask` of equal length).

`input_ids` are the prompt ids the engine rendered for that answer followed by the ids it
generated, `loss_mask` 0 on the prompt and 1 on exactly the generated ids. Only runs made with
--token-ids have them (records keep `token_ids` per answer); a record without them is refused,
never re-tokenized. Each row's `turn` is the user turn it answers (`step`: its place after tool
results), its `usage` that answer's own, its `id` the record's with `-a<n>` (the n-th answer,
from 0), its `outcome` the generation row's of the same answer (generations.answer_outcomes), so
a token row and its text row share id and fate. A history the input wrote is prompt, loss 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genqueue.common.errors import UserError
from genqueue.common.records import ResultRecord
from genqueue.producer.export.formats.lines import META, line_id, with_acceptance, with_meta
from genqueue.producer.export.formats.spec import FormatSpec, Line
from genqueue.producer.export.generations import answer_outcomes, generations

if TYPE_CHECKING:
    import pyarrow as pa


class NoTokenIdsError(UserError):
    """--format tokens met a record without token ids (made before the run asked for them)."""


def to_tokens(rec: ResultRecord, *, per_turn: bool = False) -> list[Line]:
    """The tokens-format rows of a success record: one per generated answer (see the module
    docstring), the answers of generations() each with its outcome as answer_outcomes judges it
    (the generation rows' rule). Raises NoTokenIdsError for a record that kept no ids."""
    base = line_id(rec, per_turn=per_turn)
    try:
        gens = generations(rec)
    except ValueError as e:
        raise NoTokenIdsError(f"--format tokens: record {rec.get('key')} (id {base}): {e}") from None
    rows: list[Line] = []
    for g, outcome in zip(gens, answer_outcomes(rec, gens), strict=True):
        if g.token_ids is None or g.prompt_ids is None:
            raise NoTokenIdsError(
                f"--format tokens: record {rec.get('key')} (id {base}) has no token ids for its answer {g.index}: "
                "the run kept none when it was made (enqueue with --token-ids, on a server that returns them)")
        completion = g.token_ids["completion"]
        row: Line = {"id": f"{base}-a{g.index}", "input_ids": g.prompt_ids + completion,
                     "loss_mask": [0] * len(g.prompt_ids) + [1] * len(completion)}
        with_meta(rec, row, META + ("model", "fingerprint"))
        row["turn"] = g.turn
        if g.step:
            row["step"] = g.step
        row["outcome"], row["usage"] = outcome, g.usage
        rows.append(with_acceptance(row, [g.spec]))
    return rows


def schema() -> pa.Schema:
    """The Arrow schema of tokens rows."""
    import pyarrow as pa

    from genqueue.producer.export.formats.arrow import META as ARROW_META

    return pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("step", pa.int64()), *ARROW_META])


SPEC = FormatSpec(
    "one row per generated answer: input_ids (the prompt ids the engine rendered, then the ids it generated) "
    "and a loss_mask of 1 on exactly the generated ids, as speculators trains on them (runs made with "
    "--token-ids)", lambda rec, *, per_turn=False: to_tokens(rec, per_turn=per_turn)[0],
    rows=to_tokens, schema=schema, token_ids=True)
