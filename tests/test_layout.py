"""The package layout holds: genqueue.producer and genqueue.consumer both stand on genqueue.common,
never on each other, and no genqueue module imports itself back through others.

The import graph is built from the source (the AST of every module under common/, producer/ and
consumer/), not by importing anything, so it sees imports inside functions and under
TYPE_CHECKING too: a lazy import is still a dependency, and a type-only cycle is still two
modules that cannot be understood apart.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "consumer")
NAMESPACE = "genqueue"


def module_files() -> dict[str, Path]:
    """genqueue.<package>.<...> -> its file, for every module of the three packages."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = [NAMESPACE, *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, int, bool]]:
    """(absolute module name, line, type_only) of every import in TREE; `from X import Y` also
    gives X.Y (Y may be a submodule). type_only: under `if TYPE_CHECKING:`."""

    def walk(node: ast.AST, type_only: bool) -> Iterator[tuple[str, int, bool]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, type_only
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, node.lineno, type_only
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, True)
            for child in node.orelse:
                yield from walk(child, type_only)
        else:
            for sub in ast.iter_child_nodes(node):
                yield from walk(sub, type_only)

    yield from walk(tree, False)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(*, with_type_only: bool = True) -> tuple[dict[str, set[str]], list[str]]:
    """Edges between genqueue modules (without the TYPE_CHECKING ones unless WITH_TYPE_ONLY),
    and any import of the bare top-level folders."""
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    bare: list[str] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line, type_only in imported_names(tree, module, path.name == "__init__.py"):
            top = name.split(".")[0]
            if top in PACKAGES:
                bare.append(f"{path.relative_to(ROOT)}:{line} imports {name} (write {NAMESPACE}.{name})")
            if name in files and name != module and (with_type_only or not type_only):
                graph[module].add(name)
    return graph, bare


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of GRAPH as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def package_of(module: str) -> str:
    return module.split(".")[1]


def test_the_graph_is_read_from_every_module() -> None:
    graph, _ = import_graph()
    assert {"genqueue.common.contracts", "genqueue.common.storage", "genqueue.common.storage.s3",
            "genqueue.common.keepers.rqaccess", "genqueue.producer.export.command", "genqueue.consumer.shipping.shards"} <= graph.keys()
    # one edge of each kind the rules below look at, so the test cannot pass by reading nothing
    assert "genqueue.common.storage.s3" in graph["genqueue.producer.export.sources"] or \
        "genqueue.common.storage" in graph["genqueue.producer.export.sources"]
    assert "genqueue.common.storage" in graph["genqueue.consumer.shipping.shards"]


def test_no_bare_package_imports() -> None:
    _, bare = import_graph()
    assert bare == []


@pytest.mark.parametrize(("a", "b"), [("producer", "consumer"), ("consumer", "producer")])
def test_producer_and_consumer_never_import_each_other(a: str, b: str) -> None:
    graph, _ = import_graph()
    edges = sorted(f"{m} -> {n}" for m, deps in graph.items() for n in deps
                   if package_of(m) == a and package_of(n) == b)
    assert edges == []


def test_common_imports_neither_side() -> None:
    graph, _ = import_graph()
    edges = sorted(f"{m} -> {n}" for m, deps in graph.items() for n in deps
                   if package_of(m) == "common" and package_of(n) != "common")
    assert edges == []


def test_no_import_cycles() -> None:
    """A cycle at run time: which module runs first decides what the other one sees."""
    graph, _ = import_graph(with_type_only=False)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycles_through_type_checking_imports() -> None:
    """A cycle through `if TYPE_CHECKING:` runs fine, but the two modules are one piece split
    across files (a module reaching into the fields of the one that imports it)."""
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse("from . import x\nfrom ..common.y import z\nimport genqueue.common.w\n"
                     "if TYPE_CHECKING:\n    from genqueue.consumer import t\nelse:\n    import genqueue.common.u\n"
                     "def f():\n    import genqueue.common.v\n")
    names = {n: t for n, _, t in imported_names(tree, "genqueue.producer.m", False)}
    assert {"genqueue.producer.x", "genqueue.common.y", "genqueue.common.y.z", "genqueue.common.w",
            "genqueue.common.u", "genqueue.common.v", "genqueue.consumer.t"} <= names.keys()
    assert names["genqueue.consumer.t"] and not names["genqueue.common.u"] and not names["genqueue.common.v"]


# The wings: parts of a package that are a program of their own, each in its folder, whose
# docstring says what it is for and, on its `May import:` line, what it may stand on.
WINGS = ("genqueue.consumer.launch", "genqueue.consumer.sim", "genqueue.consumer.answer",
         "genqueue.consumer.dashboard", "genqueue.consumer.shipping", "genqueue.consumer.engine",
         "genqueue.consumer.work", "genqueue.consumer.guards", "genqueue.producer.ingest",
         "genqueue.producer.enqueue", "genqueue.producer.export", "genqueue.producer.status",
         "genqueue.producer.drafter", "genqueue.common.keepers")

#: The answering wing's modules, once on consumer/'s top level.
ANSWER_MODULES = ("generate", "records", "completion", "client", "faults", "tool_turns", "checkpoints")
#: The other wings' modules that once sat on consumer/'s top level.
MOVED_OFF_THE_CONSUMER_FLOOR = ("outbox", "shards", "engine", "doctor", "admission", "intake", "leases", "acker",
                                "book", "shares", "breaker", "ended", "rewind", "stop", "supervise")
#: consumer/'s top level: the composition root (worker), its CLI and config, the job function rq
#: names (task: stored in every job, it cannot move), rq's adapter and thread, the events the parts
#: report through, and the parts that join the wings (dispatch, served, copies, telemetry, metrics).
CONSUMER_FLOOR = ("__init__", "__main__", "cli", "config", "worker", "task", "rqcompat", "rqthread",
                  "events", "dispatch", "served", "copies", "telemetry", "metrics")
#: The enqueue wing's modules that once sat on producer/'s top level.
MOVED_OFF_THE_PRODUCER_FLOOR = ("enqueue", "jobwriter", "memplan", "order", "reconcile", "runsetup", "cost")


def allowed_imports(wing: str) -> tuple[str, ...]:
    """The prefixes named on the wing's `May import:` line (`nothing outside the wing`: none)."""
    doc = ast.get_docstring(ast.parse(module_files()[wing].read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert len(lines) == 1, f"{wing}'s docstring has no single 'May import:' line"
    spec = lines[0].removeprefix("May import:").strip()
    return () if spec == "nothing outside the wing" else tuple(p.strip() for p in spec.split(","))


def allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_imports_only_what_its_docstring_allows(wing: str) -> None:
    graph, _ = import_graph()
    prefixes = allowed_imports(wing)
    assert len(module_files()) > 0 and any(m.startswith(wing + ".") for m in graph)
    edges = sorted(f"{m} -> {n}" for m, deps in graph.items() if m == wing or m.startswith(wing + ".")
                   for n in deps if not allowed(n, (wing,)) and not allowed(n, prefixes))
    assert edges == []


@pytest.mark.parametrize(("wing", "users"), [
    ("genqueue.consumer.sim", ("genqueue.consumer.cli",)),
    ("genqueue.consumer.launch", ("genqueue.consumer.cli",)),
    ("genqueue.consumer.dashboard", ("genqueue.consumer.cli",)),
    ("genqueue.producer.export", ("genqueue.producer.cli",)),
    ("genqueue.producer.status", ("genqueue.producer.cli",)),
    ("genqueue.producer.drafter", ("genqueue.producer.cli",)),
    ("genqueue.producer.enqueue", ("genqueue.producer.cli", "genqueue.producer.prefill.command")),
])
def test_the_worker_and_the_run_never_reach_into_a_wing(wing: str, users: tuple[str, ...]) -> None:
    """The stand-in, the launcher, the dashboard, the export, the status and the enqueue are
    commands: only the CLI that registers them imports them (the enqueue: the capture pass too),
    so the worker cannot come to depend on the stand-in (or enqueue on export, or status on
    enqueue)."""
    graph, _ = import_graph()
    edges = sorted(f"{m} -> {n}" for m, deps in graph.items() if not allowed(m, (wing,)) and m not in users
                   for n in deps if allowed(n, (wing,)))
    assert edges == []


def test_every_wing_is_in_its_folder() -> None:
    """No wing's module is left on its package's top level under the old flat names."""
    flat = sorted(str(p.relative_to(ROOT)) for pattern in ("consumer/launch*.py", "consumer/sim*.py",
                                                           "consumer/dashboard*.py", "producer/export*.py",
                                                           "producer/status*.py",
                                                           *(f"consumer/{m}.py" for m in ANSWER_MODULES),
                                                           *(f"consumer/{m}.py" for m in MOVED_OFF_THE_CONSUMER_FLOOR),
                                                           *(f"producer/{m}.py" for m in MOVED_OFF_THE_PRODUCER_FLOOR))
                  for p in ROOT.glob(pattern))
    assert flat == []
    for wing in WINGS:
        assert module_files()[wing].name == "__init__.py"


def test_the_consumer_floor_is_read_in_one_look() -> None:
    """A newcomer opens consumer/ and sees the worker, its CLI, and the wings (folders)."""
    floor = sorted(p.stem for p in (ROOT / "consumer").glob("*.py"))
    assert floor == sorted(CONSUMER_FLOOR)


def test_the_wing_rule_reads_what_it_should() -> None:
    assert allowed_imports("genqueue.consumer.sim") == ("genqueue.common.features.standin",)
    assert allowed_imports("genqueue.consumer.answer") == ("genqueue.common",)
    assert {f"genqueue.consumer.answer.{m}" for m in ANSWER_MODULES} <= module_files().keys()
    assert "genqueue.common" in allowed_imports("genqueue.producer.export")
    assert allowed("genqueue.common.keepers.runs", ("genqueue.common",))
    assert not allowed("genqueue.commonplace", ("genqueue.common",))


# common/ split by nature: the keepers of Redis state in common/keepers/, the pure half around them
# (contracts, settings, conversions, rules; common/storage/ is the output store's I/O, neither).
#: Redis client methods that are also everyday method names (a dict's get, a file's close, ...):
#: a call of one of these says nothing of Redis.
_EVERYDAY = frozenset({"append", "copy", "get", "keys", "sort", "close", "reset", "wait", "select", "save",
                       "set", "delete", "time", "type", "info", "move", "object", "sync", "touch", "lock",
                       "dump", "json", "client", "command", "publish", "scan", "rename", "exists", "echo",
                       "restore", "role", "monitor", "quit", "digest", "ts", "ft", "bf", "cf", "topk",
                       "cms", "tdigest", "vset", "load_external_module", "from_url", "from_pool"})


def redis_commands() -> frozenset[str]:
    import redis
    return frozenset(n for n in dir(redis.Redis) if not n.startswith(("_", "get_", "set_"))
                     and callable(getattr(redis.Redis, n)) and n not in _EVERYDAY
                     and n not in dir(dict) and n not in dir(list) and n not in dir(str))


def redis_touches(tree: ast.Module, commands: frozenset[str]) -> list[str]:
    """What in TREE speaks to Redis: an import of redis (its exceptions aside) or rq, and a call
    of a Redis command method (`.hset(`, `.pipeline(`, `.register_script(`, ...)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in {"redis", "rq"}
                      and a.name != "redis.exceptions"]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            if mod.split(".")[0] in {"redis", "rq"} and mod != "redis.exceptions":
                found.append(f"{node.lineno}: from {mod} import")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in commands:
            found.append(f"{node.lineno}: .{node.func.attr}(")
    return found


def pure_common() -> dict[str, Path]:
    return {m: p for m, p in module_files().items() if package_of(m) == "common"
            and not allowed(m, ("genqueue.common.keepers", "genqueue.common.storage"))}


def test_the_pure_half_of_common_issues_no_redis_command() -> None:
    commands = redis_commands()
    found = sorted(f"{path.relative_to(ROOT)}:{hit}" for path in pure_common().values()
                   for hit in redis_touches(ast.parse(path.read_text()), commands))
    assert found == []
    assert {"genqueue.common.contracts", "genqueue.common.settings", "genqueue.common.defaults"} <= pure_common().keys()


def test_the_pure_half_of_common_stands_on_no_keeper() -> None:
    graph, _ = import_graph()
    edges = sorted(f"{m} -> {n}" for m in pure_common() for n in graph[m] if allowed(n, ("genqueue.common.keepers",)))
    assert edges == []


def test_every_module_of_common_that_speaks_to_redis_is_a_keeper() -> None:
    """The other direction: the keepers folder holds every Redis-speaking module of common/, and
    each of them does speak to Redis (or is the plumbing the others stand on)."""
    commands = redis_commands()
    keepers = {m: p for m, p in module_files().items() if allowed(m, ("genqueue.common.keepers",))
               and p.name != "__init__.py"}
    assert len(keepers) >= 15
    silent = sorted(m for m, p in keepers.items() if not redis_touches(ast.parse(p.read_text()), commands)
                    and not any(allowed(n, ("genqueue.common.keepers",)) for n in import_graph()[0][m]))
    assert silent == []


def test_the_redis_command_finder_finds_commands() -> None:
    """The rule above is able to fail: each way of speaking to Redis is seen, everyday calls are not."""
    tree = ast.parse("import redis\nfrom rq import Queue\nfrom redis.exceptions import RedisError\nd = {}\n"
                     "d.get('a')\nconn.hset('k', 'f', 1)\npipe = conn.pipeline()\nconn.register_script('x')\n"
                     "f.close()\ns.time()\n")
    assert redis_touches(tree, redis_commands()) == ["1: import redis", "2: from rq import", "6: .hset(",
                                                      "7: .pipeline(", "8: .register_script("]


# rq below its documented surface: the two adapters docs/design.md names, and no other module.
RQ_ADAPTERS = ("consumer/rqcompat.py", "common/keepers/rqaccess.py")


def rq_patches(tree: ast.Module) -> list[int]:
    """Lines of TREE that patch rq: an assignment to, or setattr/delattr on, an attribute of a
    name bound to rq (`import rq[.x] [as y]`, `from rq[.x] import Name [as n]`), at any depth."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "rq"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "rq":
            bound |= {a.asname or a.name for a in node.names}

    def of_rq(node: ast.expr) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in bound

    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"setattr", "delattr"}
              and node.args and of_rq(node.args[0])):
            lines.append(node.lineno)
        lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and of_rq(t.value)]
    return sorted(lines)


def test_rq_is_patched_only_by_its_adapters() -> None:
    """A patch of rq anywhere else (the dashboard's sweep in Redis's clock once was one) is rq
    behaviour the rq contract tests and the rq pin's comment do not know about."""
    found = sorted(f"{path.relative_to(ROOT)}:{line}" for path in module_files().values()
                   if str(path.relative_to(ROOT)) not in RQ_ADAPTERS
                   for line in rq_patches(ast.parse(path.read_text())))
    assert found == []
    # the adapters' own patches are seen, so the rule cannot pass by reading nothing
    for adapter in RQ_ADAPTERS:
        assert rq_patches(ast.parse((ROOT / adapter).read_text())), adapter


def test_the_rq_patch_finder_finds_patches() -> None:
    tree = ast.parse("import rq.utils\nfrom rq.registry import StartedJobRegistry as S\nfrom rq import job\n"
                     "import json\nweb = object()\n"
                     "def f():\n    setattr(S, 'cleanup', 1)\n    rq.utils.now = 2\n    job.zlib += 3\n"
                     "    setattr(web, 'Worker', 4)\n    json.x = 5\n    S = 6\n    del S.cleanup\n")
    assert rq_patches(tree) == [7, 8, 9, 13]


# Tunables: module-level numbers that set behaviour (timeouts, intervals, sizes, counts, ratios).
# What a user may tune (an option's or a variable's default) lives in common/defaults.py, which
# tests/common/test_defaults_once.py holds; any other number lives beside the code it governs,
# with its one-line reason in a `#:` comment directly above it.
#: Modules whose numbers are not genqueue's tunables: the stand-in vLLM may import nothing (its
#: numbers are the model of an engine, not settings of genqueue).
NOT_TUNABLES = ("consumer/sim/",)


def _numeric(node: ast.expr) -> bool:
    """A number written out: an int or float literal (not a bool), or arithmetic of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    return False


def literal_tunables(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of each name bound at module level in TREE (under if/try too) to a number
    written out. The rule: a module-level name whose value is a numeric literal sets behaviour,
    so it is a tunable; annotations without a value, class bodies (Enum members, protocol
    tables), __all__ and non-numeric values are not looked at."""
    found: list[tuple[str, int]] = []

    def body(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Assign) and _numeric(s.value):
                found.extend((t.id, s.lineno) for t in s.targets if isinstance(t, ast.Name) and t.id != "__all__")
            elif isinstance(s, ast.AnnAssign) and s.value is not None and _numeric(s.value) \
                    and isinstance(s.target, ast.Name):
                found.append((s.target.id, s.lineno))
            elif isinstance(s, ast.If | ast.Try):
                body(s.body)
                body(s.orelse)

    body(tree.body)
    return found


def unexplained_tunables(source: str) -> list[str]:
    """The literal tunables of SOURCE without a `#:` reason on the line directly above them."""
    lines = source.splitlines()
    return [name for name, line in literal_tunables(ast.parse(source))
            if line < 2 or not lines[line - 2].lstrip().startswith("#:")]


def test_no_new_literal_tunable_outside_defaults() -> None:
    found = sorted(f"{rel}:{name}" for path in (ROOT / pkg for pkg in PACKAGES)
                   for file in sorted(path.rglob("*.py"))
                   if (rel := str(file.relative_to(ROOT))) != "common/defaults.py"
                   and not rel.startswith(NOT_TUNABLES)
                   for name in unexplained_tunables(file.read_text()))
    assert found == [], "numbers without their reason: a `#:` line above each (a user's default: common/defaults.py)"


def test_the_tunable_finder_finds_tunables() -> None:
    tree = ast.parse("import enum\nTIMEOUT = 5.0\nSIZE: int = 16 * 1024\nFLAG = True\nNAME = 'x'\n"
                     "__all__ = ['f']\nLIMIT: int\nclass C(enum.IntEnum):\n    A = 1\n"
                     "if X:\n    RETRY = -3\nfrom genqueue.common import defaults\nD = defaults.LEASE_SECONDS\n")
    assert [name for name, _ in literal_tunables(tree)] == ["TIMEOUT", "SIZE", "RETRY"]


def test_a_planted_bare_literal_fails_the_rule() -> None:
    """A number with its reason directly above passes; one without, or with a plain comment, or
    with its reason a line away, does not."""
    source = ("#: Seconds a look waits: the reason.\nEXPLAINED = 2.0\n"
              "BARE = 30\n"
              "# a plain comment is no reason\nPLAIN = 1 << 20\n"
              "#: a reason a blank line away\n\nAWAY = 0.5\n"
              "#: two lines of reason,\n#: the last one directly above\nLONG: int = 64 * 1024\n"
              "if X:\n    NESTED = 3\n")
    assert unexplained_tunables(source) == ["BARE", "PLAIN", "AWAY", "NESTED"]
    real = (ROOT / "consumer" / "engine" / "doctor.py").read_text()
    assert unexplained_tunables(real) == [] and literal_tunables(ast.parse(real)), "the rule reads real modules"
    log_line = "\nlog = logging.getLogger(__name__)\n"
    planted = real.replace(log_line, f"{log_line}PLANTED = 7\n", 1)
    assert unexplained_tunables(planted) == ["PLANTED"]


# Claim sets have one keeper: common/keepers/claims.py builds their keys and writes them.
CLAIMS_KEEPER = "common/keepers/claims.py"


def claim_key_builders(tree: ast.Module) -> list[int]:
    """Lines of TREE that build a claim set's key: a text holding "claim:" (an f-string's parts
    too; docstrings, which only name the key, left out), or a call of claim_key."""
    found: list[int] = []
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "claim:" in node.value \
                and id(node) not in prose or isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id == "claim_key")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "claim_key")):
            found.append(node.lineno)
    return sorted(set(found))


def test_only_the_claims_keeper_builds_a_claim_key() -> None:
    found = [f"{rel}:{line}" for path in (ROOT / pkg for pkg in PACKAGES) for file in sorted(path.rglob("*.py"))
             if (rel := str(file.relative_to(ROOT))) != CLAIMS_KEEPER
             for line in claim_key_builders(ast.parse(file.read_text()))]
    assert found == [], f"claim keys built outside {CLAIMS_KEEPER}: {found}"
    assert claim_key_builders(ast.parse((ROOT / CLAIMS_KEEPER).read_text())), "the keeper builds them"


def test_the_claim_key_finder_finds_claim_keys() -> None:
    tree = ast.parse("from x import claim_key, runs\nA = claim_key('r', 'c')\nB = f'genqueue:run:{r}:claim:{c}'\n"
                     "C = runs.claim_key('r', 'c')\nD = 'claimed'\nE = run_key(r, 'keys')\n"
                     "def f():\n    'A claim set, genqueue:run:<run>:claim:<id>.'\n")
    assert claim_key_builders(tree) == [2, 3, 4]
