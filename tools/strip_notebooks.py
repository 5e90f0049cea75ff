"""Strip outputs from notebooks so they are committed clean (nbstripout-like, no extra dependency).

    python tools/strip_notebooks.py notebooks/*.ipynb          # rewrite in place
    python tools/strip_notebooks.py --check notebooks/*.ipynb  # exit 1 and list the dirty ones

Removes cell outputs, execution counts, widget state and per-cell execution metadata; keeps cell
tags (gpu, nbval-* etc.). The JSON is written the way Jupyter writes it (indent 1, trailing newline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CELL_METADATA_DROP = ("execution", "collapsed", "scrolled", "ExecuteTime")
NOTEBOOK_METADATA_DROP = ("widgets", "toc", "varInspector")


def strip(nb: dict) -> dict:
    """The notebook without outputs, execution counts or run-time metadata (a new dict)."""
    nb = json.loads(json.dumps(nb))
    for key in NOTEBOOK_METADATA_DROP:
        nb.get("metadata", {}).pop(key, None)
    for cell in nb.get("cells", []):
        for key in CELL_METADATA_DROP:
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def is_clean(path: Path) -> bool:
    """True when the file on disk is already exactly what `strip` would write."""
    text = path.read_text(encoding="utf-8")
    return text == dumps(strip(json.loads(text)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only report notebooks that need stripping")
    args = parser.parse_args(argv)
    dirty = [p for p in args.paths if not is_clean(p)]
    if args.check:
        for p in dirty:
            print(f"{p}: has outputs or run-time metadata; run python tools/strip_notebooks.py {p}")
        return 1 if dirty else 0
    for p in dirty:
        p.write_text(dumps(strip(json.loads(p.read_text(encoding="utf-8")))), encoding="utf-8")
        print(f"stripped {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
