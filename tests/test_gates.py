"""The schema gates bite: buf breaking, buf lint, and scripts/gates.sh on a stale tree.

Every change happens in a scratch copy under tmp_path, never in the working tree.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / ".venv" / "bin" / "buf"
BASELINE = ROOT / "compat" / "pdproto.v1.baseline.json"
COMMON = Path("protos/pdproto/v1/common.proto")

# Edits to common.proto, each (old text, new text). ProtocolVersion and Endpoint are
# in the baseline, so these are stable anchors.
RENUMBER = ("  uint32 port = 2;\n", "  uint32 port = 20;\n")
DROP_COMMENT = ("// Endpoint is a host and port pair", "")
BAD_FORMAT = ("  uint32 port = 2;\n", "      uint32 port = 2;\n")
ADD_FIELD = (
    "  uint32 port = 2;\n",
    "  uint32 port = 2;\n  // Added by tests/test_gates.py in a scratch copy.\n  string zone = 3;\n",
)


def edit(root: Path, change: tuple[str, str], path: Path = COMMON) -> None:
    """Apply one text edit to a proto in a scratch copy; the anchor must exist once."""
    target = root / path
    text = target.read_text()
    old, new = change
    assert text.count(old) == 1, f"anchor {old!r} not found once in {path}"
    if not new and old.startswith("//"):
        # Drop the whole comment line, not just the anchor text.
        lines = [line for line in text.splitlines(keepends=True) if not line.startswith(old)]
        target.write_text("".join(lines))
    else:
        target.write_text(text.replace(old, new))


def schema_copy(tmp: Path) -> Path:
    """protos/ and buf.yaml, copied."""
    shutil.copytree(ROOT / "protos", tmp / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp / "buf.yaml")
    return tmp


def buf(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run buf in ``root``."""
    return subprocess.run([str(BUF), *args], cwd=root, capture_output=True, text=True, check=False)


def test_unchanged_schema_passes_breaking(tmp_path: Path) -> None:
    run = buf(schema_copy(tmp_path), "breaking", "--against", str(BASELINE))
    assert run.returncode == 0, run.stdout + run.stderr


def test_renumbered_field_fails_breaking_with_exit_100(tmp_path: Path) -> None:
    root = schema_copy(tmp_path)
    edit(root, RENUMBER)
    run = buf(root, "breaking", "--against", str(BASELINE))
    assert run.returncode == 100, run.stdout + run.stderr
    # buf reports a renumbered field as the old number deleted.
    assert 'field "2" with name "port"' in run.stdout


def test_missing_comment_fails_lint(tmp_path: Path) -> None:
    root = schema_copy(tmp_path)
    assert buf(root, "lint").returncode == 0
    edit(root, DROP_COMMENT)
    run = buf(root, "lint")
    assert run.returncode == 100, run.stdout + run.stderr
    assert 'Message "Endpoint" should have a non-empty comment' in run.stdout


def repo_copy(tmp: Path) -> Path:
    """What scripts/gates.sh reads, copied; the venv is linked, not copied."""
    root = tmp / "repo"
    for name in ("protos", "compat", "scripts"):
        shutil.copytree(ROOT / name, root / name)
    shutil.copytree(ROOT / "pdproto" / "v1", root / "pdproto" / "v1",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "buf.yaml", root / "buf.yaml")
    (root / ".venv").symlink_to(ROOT / ".venv")
    return root


@pytest.mark.parametrize(
    ("change", "gate", "then_skipped"),
    [
        (DROP_COMMENT, "buf lint", "buf format"),
        (BAD_FORMAT, "buf format", "buf breaking"),
        (RENUMBER, "buf breaking", "generated code"),
        # Additive and well formed, so only the regenerate-and-diff gate can catch it.
        (ADD_FIELD, "generated code is stale", "mypy"),
    ],
    ids=["lint", "format", "breaking", "stale-generated-code"],
)
def test_gates_script_fails_on_each_gate(
    tmp_path: Path, change: tuple[str, str], gate: str, then_skipped: str
) -> None:
    root = repo_copy(tmp_path)
    generated = root / "pdproto" / "v1"
    before = {p.name: p.read_bytes() for p in generated.iterdir()}
    edit(root, change)
    run = subprocess.run(["bash", "scripts/gates.sh", "--no-mypy"], cwd=root,
                         capture_output=True, text=True, check=False)
    assert run.returncode != 0, run.stdout + run.stderr
    assert f"gate failed: {gate}" in run.stderr, run.stdout + run.stderr
    assert then_skipped not in run.stdout  # the failure stopped the run
    assert "all passed" not in run.stdout
    # The regenerate-and-diff gate works on its own scratch copy, never in place.
    assert {p.name: p.read_bytes() for p in generated.iterdir()} == before


def test_gates_script_fails_on_a_hand_edited_init(tmp_path: Path) -> None:
    # pdproto/v1/__init__.py is generated too: editing it by hand must fail the diff gate.
    root = repo_copy(tmp_path)
    init = root / "pdproto" / "v1" / "__init__.py"
    init.write_text(init.read_text() + "\nEXTRA = 1\n")
    run = subprocess.run(["bash", "scripts/gates.sh", "--no-mypy"], cwd=root,
                         capture_output=True, text=True, check=False)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "gate failed: generated code is stale" in run.stderr, run.stdout + run.stderr
    assert "EXTRA = 1" in run.stdout  # the diff shows the hand edit


def test_gates_script_fails_on_a_stub_the_generator_no_longer_writes(tmp_path: Path) -> None:
    # A proto without a service gets no *_pb2_grpc module; a leftover one is stale.
    root = repo_copy(tmp_path)
    (root / "pdproto" / "v1" / "common_pb2_grpc.py").write_text("# left over\n")
    run = subprocess.run(["bash", "scripts/gates.sh", "--no-mypy"], cwd=root,
                         capture_output=True, text=True, check=False)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "gate failed: generated code is stale" in run.stderr, run.stdout + run.stderr
    assert "common_pb2_grpc.py" in run.stdout
