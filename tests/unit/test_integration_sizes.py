"""An engine's integration is glue over the engine port (gpumem.port): each folder under
client/gpumem/integrations/ holds at most GLUE_LINES lines of code, counted without
docstrings, comments and blank lines (issue 36), so that it cannot grow back into a
second copy of the port."""

from __future__ import annotations

import ast
import io
import tokenize

import pytest

from conftest import ROOT

GLUE_LINES = 250
INTEGRATIONS = ROOT / "client" / "gpumem" / "integrations"
SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines holding a token of code: a docstring (a module's, class's or function's first
    string statement), a comment or a blank line counts for nothing."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docs)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    source = '"""Module doc,\ntwo lines."""\n\nimport os  # why\n\n\ndef f(\n    a: int,\n) -> int:\n    """Doc."""\n    # a comment\n    return a + len(os.sep)\n'
    assert code_lines(source) == 5  # import, the def's three lines, return


@pytest.mark.parametrize("folder", sorted(p.name for p in INTEGRATIONS.iterdir() if (p / "__init__.py").exists()))
def test_an_engines_glue_stays_within_its_lines(folder: str) -> None:
    counted = {p.name: code_lines(p.read_text()) for p in sorted((INTEGRATIONS / folder).rglob("*.py"))}
    assert sum(counted.values()) <= GLUE_LINES, f"integrations/{folder}/ has {sum(counted.values())} code lines ({counted}), past {GLUE_LINES}: what is not the engine's belongs in gpumem.port"
