"""The unit tests share one set of doubles (tests/doubles.py): no test module writes its own fake
connection, pipeline, worker, outbox or gate."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DOUBLES = ("Fake", "Stub", "Dummy", "Mock")


def own_doubles(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.name}:{node.lineno} class {node.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.name.lstrip("_").startswith(DOUBLES)]


def test_no_test_module_writes_its_own_doubles() -> None:
    found = [line for path in sorted(TESTS.rglob("*.py")) if path.name != "doubles.py"
             for line in own_doubles(path)]
    assert found == []


def test_the_check_sees_a_double(tmp_path: Path) -> None:
    planted = tmp_path / "test_x.py"
    planted.write_text("def f():\n    class _FakeConn:\n        pass\n")
    assert own_doubles(planted) == ["test_x.py:2 class _FakeConn"]
    assert own_doubles(TESTS / "doubles.py")  # the doubles themselves are seen
