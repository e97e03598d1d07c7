"""The README's cluster path (between `<!-- cluster-path:begin -->` and `<!-- cluster-path:end -->`):
its shell commands and its Python snippet, for the tests that keep them true."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section() -> str:
    text = README.read_text()
    return text.split("<!-- cluster-path:begin -->", 1)[1].split("<!-- cluster-path:end -->", 1)[0]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(), flags=re.S)


def commands() -> list[list[str]]:
    """Every shell command of the bash blocks, continuation lines joined, comments and `&` dropped."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                out.append(words)
    return out


def command(*prefix: str) -> list[list[str]]:
    return [c for c in commands() if c[: len(prefix)] == list(prefix)]


def inline_applies() -> list[list[str]]:
    """`kubectl apply ...` commands quoted inline in the section's text (the optional routes)."""
    return [shlex.split(c) for c in re.findall(r"`(kubectl apply [^`]+)`", section())]
