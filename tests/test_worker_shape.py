"""The worker stays small enough to reason about (issue 19): no function of its modules graded D or
worse by radon's cyclomatic complexity (above 20), no class with more than 15 instance attributes
(assignments to `self.X` in its methods, and its `__slots__`)."""

from __future__ import annotations

import ast
from pathlib import Path

from radon.complexity import cc_rank, cc_visit

import scheduler_grpc.worker

WORKER = Path(scheduler_grpc.worker.__file__).parent
MODULES = sorted(WORKER.glob("*.py"))
MAX_COMPLEXITY = 20  # radon's C ends at 20: 21 and above is D
MAX_ATTRIBUTES = 15


def test_the_worker_is_a_package_of_modules() -> None:
    assert len(MODULES) > 3, MODULES


def test_no_worker_function_is_graded_d_or_worse() -> None:
    graded = []
    for module in MODULES:
        for block in cc_visit(module.read_text()):
            for item in [block, *getattr(block, "methods", [])]:
                if item.complexity > MAX_COMPLEXITY:
                    graded.append(
                        f"{module.name}:{item.lineno} {item.name}: {item.complexity} ({cc_rank(item.complexity)})"
                    )
    assert not graded, graded


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Names the class's own methods assign on `self`, and its `__slots__`."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            value = ast.literal_eval(node.value)
            names.update([value] if isinstance(value, str) else value)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                targets: list[ast.expr] = []
                if isinstance(inner, ast.Assign):
                    targets = inner.targets
                elif isinstance(inner, ast.AnnAssign | ast.AugAssign):
                    targets = [inner.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if (
                            isinstance(leaf, ast.Attribute)
                            and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"
                        ):
                            names.add(leaf.attr)
    return names


def test_no_worker_class_has_more_than_fifteen_attributes() -> None:
    crowded = []
    for module in MODULES:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef):
                names = instance_attributes(node)
                if len(names) > MAX_ATTRIBUTES:
                    crowded.append(f"{module.name}:{node.lineno} {node.name}: {len(names)} {sorted(names)}")
    assert not crowded, crowded


def test_the_attribute_count_sees_slots_and_assignments() -> None:
    source = """
class C:
    __slots__ = ("a", "b")
    def __init__(self):
        self.a = 1
        self.c: int = 2
        self.d += 1
        self.e, self.f = 1, 2
"""
    [cls] = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    assert instance_attributes(cls) == {"a", "b", "c", "d", "e", "f"}
