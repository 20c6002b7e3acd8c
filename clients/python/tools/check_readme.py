"""Compiles and type-checks every ```python block of README.md (run by run-tests.sh).

A broken example fails the build. Each block becomes one module: a short
prelude declaring, by type only, the names the README's fragments take as
given (a ``retryd`` client, an ``httpx.Client`` called ``http``, a ``url``,
the caller's generated ``inventory_pb2_grpc`` and its ``request``), then
the imports of the blocks above it (a reader has read those), then the
block itself. Nothing is run: ``py_compile`` and ``mypy --strict`` only.

Usage: python tools/check_readme.py README.md [--mypy]
"""

from __future__ import annotations

import py_compile
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PRELUDE = '''\
# Glue: the names the README's fragments take as given, declared by type only.
from typing import Any
import httpx
import retryd as _retryd_package
retryd: _retryd_package.Client
http: httpx.Client
url: str
inventory_pb2_grpc: Any  # the caller's generated stubs
request: Any
'''

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_IMPORT = re.compile(r"^(import \S+|from \S+ import .+)$", re.MULTILINE)


def modules(readme: str) -> list[tuple[int, str]]:
    """(line of the block in the README, module text) for every python block."""
    found: list[tuple[int, str]] = []
    imports: list[str] = []
    for match in _BLOCK.finditer(readme):
        line = readme.count("\n", 0, match.start()) + 1
        block = match.group(1)
        found.append((line, PRELUDE + "\n".join(imports) + "\n# README.md, line %d\n" % line + block))
        imports += _IMPORT.findall(block)
    return found


def main(argv: list[str]) -> int:
    readme_path = Path(argv[1])
    blocks = modules(readme_path.read_text())
    if not blocks:
        print(f"{readme_path}: no ```python blocks found", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="readme-blocks-") as scratch:
        paths = []
        for line, text in blocks:
            path = Path(scratch) / f"readme_line_{line}.py"
            path.write_text(text)
            py_compile.compile(str(path), doraise=True)
            paths.append(str(path))
        if "--mypy" in argv:
            # A config of its own: the package's (pyproject.toml) is not for these.
            config = Path(scratch) / "mypy.ini"
            config.write_text("[mypy]\nstrict = True\nallow_redefinition = True\nincremental = False\n")
            checked = subprocess.run(
                [sys.executable, "-m", "mypy", "--config-file", str(config), *paths],
                cwd=scratch, capture_output=True, text=True,
            )
            if checked.returncode != 0:
                print(checked.stdout + checked.stderr, file=sys.stderr)
                print(f"{readme_path}: a code block does not type-check (the file name is its line)",
                      file=sys.stderr)
                return 1
    print(f"{readme_path}: {len(blocks)} python blocks compile and type-check")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
