"""parse_tables reads an answer as vLLM writes it in one pass over arrays (consumer/capture/tables.py):
over many generated logprobs.content lists, well-formed or broken in the ways an engine or a wire
can break them, it gives bit for bit the table the entry-by-entry reading it replaced gave (kept
here, unchanged, as the reference), and the same refusal: the same class and the same words."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from genqueue.common.errors import FeatureValueError
from genqueue.common.features.tables import LogprobsTable
from genqueue.common.logprobs import asked, request_fields
from genqueue.consumer.answer.faults import BadLogprobsError
from genqueue.consumer.capture import tables
from genqueue.consumer.sim.logprobs import content as standin_content

# both readings cast a value of 1e308 to float32's infinity, as the store would
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

# --- the reference: parse_tables as it was before the array pass, word for word -------------

TOKEN_PREFIX = "token_id:"


def _token_id(entry: object, where: str) -> int:
    token = entry.get("token") if isinstance(entry, dict) else None
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX) or not token[len(TOKEN_PREFIX):].isdigit():
        raise BadLogprobsError(f"{where} names its token {token!r}, not {TOKEN_PREFIX}<id> "
                               "(vLLM's return_tokens_as_token_ids)")
    return int(token[len(TOKEN_PREFIX):])


def _logprob(entry: object, where: str) -> float:
    value = entry.get("logprob") if isinstance(entry, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadLogprobsError(f"{where} has no numeric logprob")
    return float(value)


def reference_parse(content: object, k: int) -> LogprobsTable:
    if not isinstance(content, list) or not content:
        raise BadLogprobsError("the server returned no logprobs.content for the answer's tokens (a run of "
                               "--logprobs asks for logprobs and top_logprobs)")
    ids: list[int] = []
    lps: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for t, entry in enumerate(content):
        where = f"logprobs.content[{t}]"
        ids.append(_token_id(entry, where))
        lps.append(_logprob(entry, where))
        top = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(top, list) or len(top) < asked(k):
            raise BadLogprobsError(f"{where}.top_logprobs holds {len(top) if isinstance(top, list) else 'no'} "
                                   f"entries, the run asks for {asked(k)}")
        listed = {}
        for j, e in enumerate(top):
            i = _token_id(e, f"{where}.top_logprobs[{j}]")
            if i in listed:
                raise BadLogprobsError(f"{where}.top_logprobs lists token {i} twice")
            listed[i] = _logprob(e, f"{where}.top_logprobs[{j}]")
        if ids[-1] in listed and not math.isclose(listed[ids[-1]], lps[-1], rel_tol=1e-6, abs_tol=1e-6):
            raise BadLogprobsError(f"{where}: the sampled token's log-probability {lps[-1]} is listed as "
                                   f"{listed[ids[-1]]}")
        best = sorted(listed.items(), key=lambda kv: -kv[1])[:k]
        top_ids.append([i for i, _ in best])
        top_lps.append([v for _, v in best])
    try:
        return LogprobsTable.of(ids, lps, top_ids, top_lps)
    except FeatureValueError as e:
        raise BadLogprobsError(f"the log-probability tables do not fit: {e}") from None

# --- generated answers ------------------------------------------------------------------------


def outcome(parse: Any, content: object, k: int) -> tuple[object, ...]:
    """What PARSE makes of CONTENT: the table's arrays as bytes, or the exception's class and words."""
    try:
        t = parse(content, k)
    except Exception as e:  # noqa: BLE001 - any exception, compared by class and words
        return ("raised", type(e), str(e))
    return ("table", *((a.dtype.str, a.shape, a.tobytes()) for a in
                       (t.sampled_ids, t.sampled_logprobs, t.topk_ids, t.topk_logprobs)))


IDS = st.one_of(st.integers(0, 40), st.integers(0, 2**31 - 1), st.sampled_from([0, 2**31 - 1, 2**31, 10**17, 10**18]))
VALUES = st.one_of(st.sampled_from([-0.0, 0.0, -0.5, -1.0, -1.0, -2.5, 0.25, -1e-7, -1e-300, -700.0]),
                   st.floats(-50.0, 1.0, allow_nan=False, width=64), st.floats(-1.0, -1.0 + 1e-5))
BAD_TOKENS = ["1token_id:", "token_i1d:", "token_id:1:", "1token_id", "hello", "token_id:", "token_id:-1",
              "token_id:+1", "token_id:\u00b2", "token_id:\u0663",
              "token_id:\uff15", "token_id:1,token_id:2", "token_id:token_id:5", " token_id:5", "token_id:5 ",
              "token_id:" + "9" * 19, "token_id:" + "0" * 25 + "7", "token_id:007", "Token_id:5", "token_id:5\u0000",
              ",token_id:5", "token_id:5,", "token_id:18446744073709551621", 5, None, ["token_id:5"], "tok\u00e9n_id:5"]
BAD_VALUES = [True, False, None, "-0.5", 0, -3, 10**400, float("nan"), float("inf"), float("-inf"), [-0.5], 1e308]


@st.composite
def answers(draw: st.DrawFn) -> tuple[list[Any], int]:
    """A logprobs.content as vLLM writes it for a run of K (the sampled token first when listed,
    distinct ids, one width a row), before any breakage."""
    k = draw(st.integers(1, 5))
    width = asked(k) + draw(st.sampled_from([0, 0, 0, 1, 3]))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        row = draw(st.lists(IDS, min_size=width, max_size=width, unique=True))
        vals = draw(st.lists(VALUES, min_size=width, max_size=width))
        if draw(st.booleans()):  # vLLM: the sampled token listed first, at its own value or one close to it
            sid, slp = row[0], draw(st.sampled_from([vals[0], vals[0] * (1 + 5e-7), vals[0] + 2e-6, vals[0] + 0.5]))
        else:  # sampled outside the list (then the list is the top K + 1)
            sid, slp = draw(IDS.filter(lambda i, row=row: i not in row)), draw(VALUES)
        pad = draw(st.sampled_from(["", "", "", "0", "00"]))
        out.append({"token": f"token_id:{pad}{sid}", "logprob": slp, "bytes": None,
                    "top_logprobs": [{"token": f"token_id:{i}", "logprob": v, "bytes": None}
                                     for i, v in zip(row, vals, strict=True)]})
    return out, k


def _break(content: list[Any], what: str, at: int, rnd: Any) -> object:
    """CONTENT broken one way (WHAT) at a place AT picks."""
    entry = content[at % len(content)]
    inner = entry["top_logprobs"][at % len(entry["top_logprobs"])]
    target = inner if at % 2 else entry
    if what == "drop key":
        target.pop(rnd.choice(["token", "logprob", "top_logprobs"] if target is entry else ["token", "logprob"]), None)
    elif what == "token":
        target["token"] = rnd.choice(BAD_TOKENS)
    elif what == "value":
        target["logprob"] = rnd.choice(BAD_VALUES)
    elif what == "repeat id":
        others = [e for e in entry["top_logprobs"] if e is not inner]
        inner["token"] = rnd.choice(others).get("token")
    elif what == "sampled listed":
        entry["token"] = inner.get("token")
    elif what == "shorter":
        entry["top_logprobs"].pop()
    elif what == "longer":
        entry["top_logprobs"].append({"token": f"token_id:{10**6 + at}", "logprob": -9.0})
    elif what == "inner not a dict":
        entry["top_logprobs"][at % len(entry["top_logprobs"])] = rnd.choice([None, "x", [1], 3.0])
    elif what == "entry not a dict":
        content[at % len(content)] = rnd.choice([None, "x", [entry], 3.0])
    elif what == "top not a list":
        entry["top_logprobs"] = rnd.choice([None, {}, "x", tuple(entry["top_logprobs"])])
    elif what == "empty":
        return rnd.choice([[], None, {}, "x"])
    return content


def _breakable(content: object) -> bool:
    return isinstance(content, list) and bool(content) and all(
        isinstance(e, dict) and isinstance(e.get("top_logprobs"), list) and len(e["top_logprobs"]) > 1
        and all(isinstance(i, dict) for i in e["top_logprobs"]) for e in content)


BREAKS = ["drop key", "token", "value", "repeat id", "sampled listed", "shorter", "longer", "inner not a dict",
          "entry not a dict", "top not a list", "empty"]


@settings(max_examples=300, deadline=None)
@given(answers(), st.lists(st.tuples(st.sampled_from(BREAKS), st.integers(0, 10**6)), max_size=2), st.randoms(),
       st.sampled_from([0, 0, 0, 0, 0, 0, -1, 1, -5]), st.booleans())
def test_the_array_pass_gives_the_entry_by_entry_table_or_refusal(
        answer: tuple[list[Any], int], breaks: list[tuple[str, int]], rnd: Any, k_shift: int, wire: bool) -> None:
    content: object
    content, k = answer
    if wire:  # as the consumer gets it: through JSON (orjson: no NaN, no infinity)
        content = orjson.loads(orjson.dumps(content))
    for what, at in breaks:
        if _breakable(content):
            content = _break(content, what, at, rnd)
    k += k_shift  # a K other than the list's: narrower, wider, none
    assert outcome(tables.parse_tables, content, k) == outcome(reference_parse, content, k)


@settings(max_examples=100, deadline=None)
@given(answers())
def test_an_answer_as_vllm_writes_it_is_read_by_the_array_pass(answer: tuple[list[Any], int]) -> None:
    """(ids of up to 18 figures: longer ones are read entry by entry)"""
    content, k = answer
    assume(all(len(e["token"]) <= len("token_id:") + 18 for entry in content for e in [entry, *entry["top_logprobs"]]))
    try:
        reference_parse(content, k)
    except BadLogprobsError:
        assert tables._parse_arrays(content, k) is None
        return
    table = tables._parse_arrays(content, k)
    assert table is not None
    assert outcome(lambda c, k: table, content, k) == outcome(reference_parse, content, k)


def _seeded_answer(rnd: random.Random) -> tuple[list[Any], int]:
    """answers() drawn by a seeded Random: the sweep below covers every break the same way each run."""
    k = rnd.randint(1, 5)
    width = asked(k) + rnd.choice([0, 0, 0, 1, 3])
    pool = [rnd.randrange(40), rnd.randrange(2**31), *rnd.sample([0, 2**31 - 1, 2**31, 10**17, 10**18], 2)]
    values = [-0.0, 0.0, -0.5, -1.0, -2.5, 0.25, -1e-7, -700.0, -1.0 + 1e-6]
    out = []
    for _ in range(rnd.randint(1, 4)):
        row = rnd.sample(range(60), width) if rnd.random() < 0.7 else list(dict.fromkeys(
            [*rnd.sample(range(60), width), *pool]))[:width]
        rnd.shuffle(row)
        vals = [rnd.choice(values) if rnd.random() < 0.5 else rnd.uniform(-30, 0.5) for _ in row]
        if rnd.random() < 0.5:
            sid, slp = row[0], rnd.choice([vals[0], vals[0] * (1 + 5e-7), vals[0] + 2e-6, vals[0] + 0.5])
        else:
            sid, slp = rnd.choice([i for i in range(70) if i not in row]), rnd.choice(values)
        out.append({"token": f"token_id:{rnd.choice(['', '', '0'])}{sid}", "logprob": slp,
                    "top_logprobs": [{"token": f"token_id:{i}", "logprob": v} for i, v in zip(row, vals, strict=True)]})
    return out, k


def test_a_seeded_sweep_of_every_break_gives_the_same_table_or_refusal() -> None:
    rnd = random.Random(20261207)
    for case in range(15000):
        content: object
        content, k = _seeded_answer(rnd)
        for what in rnd.sample(BREAKS, rnd.choice([0, 1, 1, 1, 2])):
            if _breakable(content):
                content = _break(content, what, rnd.randrange(10**6), rnd)
        k += rnd.choice([0] * 8 + [-1, 1, -5])
        assert outcome(tables.parse_tables, content, k) == outcome(reference_parse, content, k), (case, content, k)


def test_the_standins_answers_at_k_20_and_127_take_the_array_pass() -> None:
    ids = [(i * 7919 + 3) % 150_000 for i in range(128)]
    for k in (1, 20, 127):
        content = orjson.loads(orjson.dumps(standin_content(request_fields(k), ids, 0, 0.0)))["content"]
        table = tables._parse_arrays(content, k)
        assert table is not None
        assert outcome(lambda c, k, t=table: t, content, k) == outcome(reference_parse, content, k)
        assert np.array_equal(table.sampled_ids, ids)
