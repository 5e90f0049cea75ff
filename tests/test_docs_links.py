"""Links between the docs resolve: every relative markdown link in README.md, docs/ and the notebooks' markdown
names a file that exists, and a `#anchor` names a heading of that file (GitHub's anchor rule), so a moved or
renamed log section breaks this test, not a reader's click."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces to hyphens, "-N" for
    the N-th repeat."""
    seen: dict[str, int] = {}
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def sources() -> list[tuple[str, Path, str]]:
    """(where, the directory links are relative to, markdown text)."""
    out = [(str(p.relative_to(ROOT)), p.parent, p.read_text()) for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out += [(f"{nb.name} cell {i}", nb.parent, "".join(c["source"])) for i, c in enumerate(cells)
                if c["cell_type"] == "markdown"]
    return out


def test_relative_links_and_anchors_resolve():
    bad = []
    for where, base, text in sources():
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (base / file).resolve() if file else None
            if path is not None and not path.exists():
                bad.append(f"{where}: {target} (no such file)")
            elif anchor and path is not None and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{where}: {target} (no such heading)")
    assert bad == []


def test_the_anchor_rule_matches_a_known_heading():
    log = ROOT / "docs" / "log" / "2026-11.md"
    assert "2026-11-29--third-gpu-call-2h200-host-after-the-compile-fixes" in anchors(log)
    assert "2026-11-29--third-gpu-call" not in anchors(log)


def test_readme_states_the_makefile_test_selection():
    """README's `make test` row quotes the marker selection the Makefile runs (the Makefile is authoritative)."""
    selection = re.search(r'pytest -q -m "([^"]+)"(?: --[\w-]+)* tests', (ROOT / "Makefile").read_text()).group(1)
    assert f'pytest -m "{selection}"' in (ROOT / "README.md").read_text()
