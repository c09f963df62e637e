"""What the docs name exists: CLI flags, environment variables, make targets, repository paths.

The project's rule is that no doc claims what the code does not do. The deeper checks live
next to what they check (docs/errors.md: tests/test_errors_table.py; docs/migration.md:
tests/test_migration_doc.py; the frame layout: tests/test_wire.py). This module catches the
plain drift they do not: a renamed flag, a dropped variable, a moved file.

* every ``--flag`` written after ``pdproto <command>`` (on one code line, or inside one
  backtick span) is a flag of that command's parser;
* every ``PDPROTO_*`` variable is read somewhere in the code;
* every ``make <target>`` in a code span or block is a Makefile target;
* every backticked path into the repository exists (globs must match a file), and every
  ``path::test`` names a function defined in that file.
"""

from __future__ import annotations

import argparse
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from pdproto_server.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(p for d in ("pdproto", "pdproto_server", "pdproto_demo", "tests") for p in (ROOT / d).rglob("README.md"))])
TOP = ("pdproto/", "pdproto_server/", "pdproto_demo/", "tests/", "docs/", "scripts/", "protos/", "compat/", "bench/")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```")


def _code(doc: Path) -> list[tuple[int, str]]:
    """(line number, text) of every code line and every backtick span of a doc."""
    out: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            out.append((n, line.split("#", 1)[0] if line.lstrip().startswith("pdproto ") else line))
        else:
            out.extend((n, span) for span in SPAN.findall(line))
    return out


@cache
def _flags(command: str) -> frozenset[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return frozenset(parser._option_string_actions)


def _where(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_pdproto_command_flags_exist(doc: Path) -> None:
    command = re.compile(r"\bpdproto (" + "|".join(SUBCOMMANDS) + r")\b(.*)")
    wrong = []
    for n, text in _code(doc):
        for match in command.finditer(text):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", match.group(2)):
                if flag not in _flags(match.group(1)):
                    wrong.append(f"{_where(doc)}:{n}: pdproto {match.group(1)} has no {flag}")
    assert not wrong


def test_every_documented_pdproto_variable_is_read_by_the_code() -> None:
    code = "\n".join(p.read_text() for d in ("pdproto", "pdproto_server", "pdproto_demo", "scripts", "bench", "tests")
                     for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh"))
    read = set(re.findall(r"PDPROTO_[A-Z0-9_]+", code))
    named = {(_where(doc), name) for doc in DOCS for name in re.findall(r"PDPROTO_[A-Z0-9_]+", doc.read_text())}
    assert named, "the docs name no PDPROTO_ variable: the scan is broken"
    assert sorted(f"{where}: {name}" for where, name in named if name not in read) == []


def test_every_documented_make_target_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    wrong = [f"{_where(doc)}:{n}: make {t}" for doc in DOCS for n, text in _code(doc)
             for t in re.findall(r"\bmake ([a-z][a-z-]*)", text) if t not in targets]
    assert not wrong


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_every_repository_path_exists(doc: Path) -> None:
    wrong = []
    for n, span in _code(doc):
        for token in re.findall(r"(?<![\w./])(?:%s)[\w./*-]*(?:::\w+)?" % "|".join(TOP), span):
            path, _, test = token.rstrip(".").partition("::")
            path = path.rstrip("/")
            ok = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if ok and test:
                ok = re.search(rf"^\s*(async )?def {test}\b", (ROOT / path).read_text(), re.M) is not None
            if not ok:
                wrong.append(f"{_where(doc)}:{n}: {token}")
    assert not wrong
