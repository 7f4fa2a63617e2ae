"""Every script a researcher runs introduces itself in `--help` with the first line of its
docstring: that line must be a whole sentence, not the start of one cut at the line break."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("sweeps", "benchmarks") for p in (ROOT / d).glob("*.py")
                 if "__doc__.splitlines()[0]" in p.read_text())


def test_the_scripts_are_found():
    assert {"format_ablation.py", "publish_study.py", "train_step.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_help_line_is_a_whole_sentence(script: Path):
    first = ast.get_docstring(ast.parse(script.read_text()), clean=False).splitlines()[0]
    assert first.rstrip().endswith("."), f"{script.name}: --help would print {first!r}"
