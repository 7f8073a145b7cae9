"""Every piece of Redis state has its owner in common/: no module of producer/ or consumer/ issues
a Redis command itself, except consumer/rqcompat.py (the one rq adapter, which speaks rq's keys).

Read from the source (the AST of every module), like tests/test_layout.py. A Redis command is a
method of redis-py's client or pipeline (the list is derived from redis-py itself), called on a
receiver, or handed to another thread as a bound method (`rq.call(conn.hset, ...)`). Names that
are also everyday Python (`get`, `set`, `keys`, `exists`, `time`, `info`, ...: a dict, a Path, an
Event, the logging and time modules have them) count only on a receiver that is a Redis
connection or pipeline: one named so (`conn`, `connection`, `redis`, `pipe`, `pipeline`, with or
without a leading underscore, as an attribute or a name), one bound from `.pipeline(...)` or
`connect(...)`, or a parameter annotated as a Redis client or pipeline.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import pytest
import redis
import redis.asyncio
import redis.client

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("producer", "consumer")

#: Modules that may issue Redis commands, each with its reason.
ALLOWED = {
    "consumer/rqcompat.py": "the one rq adapter: rq's own keys, in rq's own transactions",
}

#: Public attributes of redis-py's clients that send nothing to Redis (plumbing).
NOT_COMMANDS = {
    "aclose", "close", "from_pool", "from_url", "get_cache", "get_connection_kwargs", "get_encoder", "get_retry",
    "initialize", "load_external_module", "parse_response", "set_response_callback", "set_retry",
    # Pipeline plumbing
    "UNWATCH_COMMANDS", "annotate_exception", "discard", "load_scripts", "raise_first_error",
}


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


#: Every Redis command redis-py has: its client's methods, the async client's and a pipeline's.
COMMANDS = frozenset((_public(redis.Redis) | _public(redis.asyncio.Redis) | _public(redis.client.Pipeline))
                     - NOT_COMMANDS)

#: Commands whose names everyday Python has too: they count on a Redis receiver only.
_EVERYDAY: tuple[object, ...] = (
    dict, list, set, str, bytes, Path, collections.deque, collections.Counter, asyncio.Event, threading.Event,
    logging.Logger, time, os, os.path, json, hashlib.blake2b(), io.BufferedReader, subprocess.Popen,
    ThreadPoolExecutor, asyncio.AbstractEventLoop, click,
)
SHARED_NAMES = frozenset(COMMANDS & {n for api in _EVERYDAY for n in dir(api)}) | {
    "save",  # consumer/answer/checkpoints.py's Checkpoints.save
    "publish",  # consumer/telemetry.py's Telemetry.publish
    "delete",  # rq's Job.delete and Queue.delete
    "select",  # pyarrow's Table.select (producer/export)
    "json",  # aiohttp's response.json()
    "lock",  # threading's and runlock's `.lock` attributes
    "type",  # any object's `.type` field
}

#: Receivers that are a Redis connection or pipeline by their name.
REDIS_NAMES = frozenset({"conn", "connection", "redis", "redis_conn", "pipe", "pipeline"})
_REDIS_TYPES = re.compile(r"\b(Redis|Pipeline)\b")
_CONNECTORS = frozenset({"connect", "async_connect", "Redis", "from_url", "pipeline"})


def _name(node: ast.expr) -> str | None:
    """The last identifier of a receiver: `conn`, `self.conn`, `self.store.conn` -> `conn`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _redis_bound_names(tree: ast.AST) -> set[str]:
    """Names the module binds to a Redis client or pipeline: `with x.pipeline() as p`,
    `p = x.pipeline()`, `c = connect(url)`, `c = self.conn` (an alias of one), and parameters
    annotated as Redis or Pipeline."""
    out: set[str] = set()

    def is_redis(value: ast.expr | None) -> bool:
        if isinstance(value, ast.Call):
            return _name(value.func) in _CONNECTORS
        n = _name(value) if value is not None else None
        return n is not None and (n.lstrip("_") in REDIS_NAMES or n in out)

    def bind(target: ast.expr | None) -> None:
        if target is not None and (n := _name(target)) is not None and n not in out:
            out.add(n)
            grew.append(n)

    grew = [""]
    while grew:  # an alias of an alias: until nothing new is bound
        grew = []
        for node in ast.walk(tree):
            if isinstance(node, ast.withitem) and is_redis(node.context_expr):
                bind(node.optional_vars)
            elif isinstance(node, ast.Assign) and is_redis(node.value):
                for t in node.targets:
                    bind(t)
            elif isinstance(node, ast.AnnAssign) and is_redis(node.value):
                bind(node.target)
            elif (isinstance(node, ast.arg) and node.annotation is not None
                  and _REDIS_TYPES.search(ast.unparse(node.annotation))):
                bind(ast.Name(node.arg))
    return out


def redis_commands(source: str, filename: str = "<string>") -> list[str]:
    """Every Redis command SOURCE issues, as `file:line: receiver.command`."""
    tree = ast.parse(source, filename=filename)
    bound = _redis_bound_names(tree)

    def redis_receiver(node: ast.expr) -> bool:
        n = _name(node)
        return n is not None and (n.lstrip("_") in REDIS_NAMES or n in bound)

    found: list[ast.Attribute] = []
    note = found.append

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COMMANDS and (
                func.attr not in SHARED_NAMES or redis_receiver(func.value)):
            note(func)
        # a command handed over as a bound method: rq.call(conn.hset, ...), to_thread(conn.get, ...)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if isinstance(arg, ast.Attribute) and arg.attr in COMMANDS and redis_receiver(arg.value):
                note(arg)
    return [f"{filename}:{a.lineno}: {ast.unparse(a)}" for a in sorted(found, key=lambda a: (a.lineno, a.col_offset))]


def scanned_files() -> list[Path]:
    return [p for pkg in SCANNED for p in sorted((ROOT / pkg).rglob("*.py"))]


def commands_by_module() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        hits = redis_commands(path.read_text(), rel)
        if hits:
            out[rel] = hits
    return out


# --- the checker -------------------------------------------------------------------------
def test_the_command_list_is_redis_pys_own() -> None:
    assert {"hget", "hset", "sadd", "smismember", "eval", "evalsha", "register_script", "pipeline", "llen",
            "zrange", "execute", "watch", "multi", "scan_iter", "get", "set", "delete", "time"} <= COMMANDS
    assert not COMMANDS & {"close", "from_url", "aclose"}
    assert {"get", "set", "keys", "exists", "time", "info", "append", "delete"} <= SHARED_NAMES
    assert "hset" not in SHARED_NAMES and "pipeline" not in SHARED_NAMES


PLANTED = '''
import redis
from genqueue.common.keepers.redisconn import connect

def counts(conn, run):
    conn.hincrby("k", "f", 1)                      # 1: any receiver named conn
    with conn.pipeline(transaction=False) as p:    # 2: pipeline is a command
        p.get("a")                                 # 3: p is bound from .pipeline()
        p.execute()                                # 4
    return stats.hgetall("x")                      # 5: a name only Redis has, on anything

def later(self, r: redis.Redis):
    r.set("a", 1)                                  # 6: annotated as Redis
    self.store.conn.get("b")                       # 7: an attribute named conn
    self._conn.set("c", 2)                         # 8
    self.rq.call(self.worker.connection.get, "d")  # 9: handed over as a bound method
    c = connect("redis://")
    c.delete("e")                                  # 10: bound from connect()
    alias = self.store.conn
    alias.get("f")                                 # 11: an alias of a connection
'''

EVERYDAY = '''
import asyncio, logging, time
from pathlib import Path
log = logging.getLogger(__name__)

def fine(d: dict, path: Path, wake: asyncio.Event, rows: list, store, lock):
    d.get("a"); d.keys(); d.copy()
    path.exists(); path.unlink(); path.rename("x")
    wake.set(); rows.append(1); rows.sort()
    log.info("x"); time.time()
    store.checkpoints.save(1)
    lock.check(); print(lock.type)
    run_in(d.get, 1)
'''


def test_the_checker_finds_planted_commands() -> None:
    hits = redis_commands(PLANTED, "planted.py")
    assert [h.split(": ", 1)[1] for h in hits] == [
        "conn.hincrby", "conn.pipeline", "p.get", "p.execute", "stats.hgetall", "r.set", "self.store.conn.get",
        "self._conn.set", "self.worker.connection.get", "c.delete", "alias.get"], hits


def test_the_checker_leaves_everyday_python_alone() -> None:
    assert redis_commands(EVERYDAY) == []


def test_every_module_is_read_and_the_adapter_is_seen() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert {"consumer/worker.py", "consumer/work/intake.py", "producer/enqueue/reconcile.py", "producer/enqueue/jobwriter.py",
            "consumer/sim/app.py", "producer/export/core.py"} <= files
    # the allowed adapter does issue commands: the check would see them anywhere else
    assert len(commands_by_module().get("consumer/rqcompat.py", [])) >= 10


def test_every_exemption_names_a_module() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert set(ALLOWED) <= files


# --- the rule ----------------------------------------------------------------------------
def test_no_redis_command_outside_common_and_rqcompat() -> None:
    offending = {m: hits for m, hits in commands_by_module().items()
                 if m not in ALLOWED}
    assert not offending, "Redis commands outside common/ (give them an owner there):\n" + "\n".join(
        h for hits in offending.values() for h in hits)


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_an_allowed_module_still_needs_its_allowance(module: str) -> None:
    assert commands_by_module().get(module), f"{module} issues no Redis command: drop it from ALLOWED"


# --- inside common/keepers/: each Redis noun one class ------------------------------------
# As rq keeps one registry class per noun, a keeper's Redis commands live in the methods of
# its class (built with the connection, owning the noun's keys); a module-level function that
# speaks to Redis, `f(conn, run, ...)`, is a noun without its class. What issues no command
# (a record's kind, a key's digest) stays a function. The plumbing below is no noun of ours.
KEEPERS = ROOT / "common" / "keepers"
FREE_FUNCTIONS_ALLOWED = {
    "common/keepers/redisconn.py": "connections: making one, and its first PING",
    "common/keepers/clock.py": "Redis's TIME, which every keeper reads",
    "common/keepers/redismem.py": "Redis's INFO memory and policy, no key of ours",
    "common/keepers/rqaccess.py": "rq's own keys, whose classes are rq's registries and queues",
    "common/keepers/rqjobs.py": "the typed reader of rq's jobs, over rqaccess",
    "common/keepers/rqfailed.py": "the reader of the jobs rq gave up on, over rqaccess",
    "common/keepers/rundelete.py": "deleting a run: every noun's keys and rq's, no noun of its own",
}


def free_functions_speaking_to_redis(source: str, filename: str = "<string>") -> list[str]:
    """Module-level functions of SOURCE (not methods) that issue a Redis command."""
    tree = ast.parse(source, filename=filename)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            hits = redis_commands(ast.unparse(node), filename)
            if hits:
                found.append(f"{filename}:{node.lineno}: {node.name}")
    return found


def test_each_keeper_speaks_to_redis_through_its_class() -> None:
    found = [hit for path in sorted(KEEPERS.glob("*.py"))
             if (rel := path.relative_to(ROOT).as_posix()) not in FREE_FUNCTIONS_ALLOWED
             for hit in free_functions_speaking_to_redis(path.read_text(), rel)]
    assert found == [], "give these functions their noun's class (common/keepers/):\n" + "\n".join(found)
    assert set(FREE_FUNCTIONS_ALLOWED) <= {p.relative_to(ROOT).as_posix() for p in KEEPERS.glob("*.py")}


def test_the_free_function_finder_finds_free_functions() -> None:
    planted = '''
import redis

def mark_shipped(conn: redis.Redis, run: str) -> None:
    conn.sadd(f"genqueue:run:{run}:done", b"x")

def record_kind(rec: dict) -> str:
    return str(rec.get("outcome"))

class Marks:
    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn = conn

    def mark_shipped(self) -> None:
        self.conn.sadd("k", b"x")
'''
    assert free_functions_speaking_to_redis(planted, "planted.py") == ["planted.py:4: mark_shipped"]
