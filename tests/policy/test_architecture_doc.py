"""docs/architecture.md names every module of the package: a module added without a line
there fails here, naming it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "disttrain"


def test_architecture_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) > 100  # the package was found
    # a whole file name, not a part of another (`paths.py` is not named by `save_paths.py`)
    missing = [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(Path(m).name)}\b", text)]
    assert missing == [], f"docs/architecture.md does not name: {missing}"
