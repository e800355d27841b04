"""The shape of the tree (house style): source files are split before 600 lines, and the pdserve/
root holds only a few loose modules (the packages say where a thing lives)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_SOURCE_LINES = 600
MAX_LOOSE_ROOT_MODULES = 4
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def tracked_sources() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [REPO_ROOT / name for name in listed
            if name.endswith(SOURCE_SUFFIXES) and (REPO_ROOT / name).is_file()]


def test_no_source_file_is_over_600_lines():
    sources = tracked_sources()
    assert any(path.name == "scheduler.py" for path in sources), "the source tree was not found"
    too_long = {str(path.relative_to(REPO_ROOT)): n for path in sources
                if (n := len(path.read_text(encoding="utf-8", errors="replace").splitlines())) > MAX_SOURCE_LINES}
    assert too_long == {}


def test_the_pdserve_root_holds_at_most_four_loose_modules():
    loose = sorted(path.name for path in (REPO_ROOT / "pdserve").glob("*.py")
                   if path.name not in ("__init__.py", "__main__.py"))
    assert loose, "pdserve/ was not found"
    assert len(loose) <= MAX_LOOSE_ROOT_MODULES, f"loose modules at the pdserve/ root: {loose}"
