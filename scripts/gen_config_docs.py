"""Write the strategy-option reference in ``docs/configuration.md`` from the option fields' docstrings.

The options are documented once, under each field of :mod:`hp_lightning.core.options`; this
script renders them (one table per option group: name, type, default in YAML form, meaning)
between the two ``GENERATED`` markers of ``docs/configuration.md``. ``tests/unit/test_validation.py``
fails when the file is stale.

    .venv/bin/python scripts/gen_config_docs.py          # rewrite the section
    .venv/bin/python scripts/gen_config_docs.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN GENERATED: strategy options (scripts/gen_config_docs.py; edit the field docstrings in hp_lightning/core/options.py) -->"
END = "<!-- END GENERATED: strategy options -->"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _type(annotation: Any) -> str:
    text = re.sub(r"\b(typing|collections\.abc|datetime)\.", "", repr(annotation) if not isinstance(annotation, type) else annotation.__name__)
    return text.replace("NoneType", "None").replace("|", "\\|")


def _cell(text: str) -> str:
    text = re.sub(r":(?:class|mod|func|meth|attr):`~?([^`]+)`", r"`\1`", text)  # Sphinx roles read as code here
    return text.replace("``", "`").replace("|", "\\|")


def section() -> str:
    sys.path.insert(0, str(ROOT))
    from dataclasses import fields

    from hp_lightning.core.options import OPTION_GROUPS, field_docs, field_types

    docs, types = field_docs(), field_types()
    lines = [BEGIN, ""]
    for group in OPTION_GROUPS:
        summary = (group.__doc__ or "").strip().splitlines()[0].rstrip(".")
        lines += [f"### {summary}", "", f"`{group.__name__}` in `hp_lightning.core.options`.", ""]
        lines += ["| option | type | default | meaning |", "|---|---|---|---|"]
        own = [f for f in fields(group)]
        for f in own:
            lines.append(f"| `{f.name}` | `{_type(types[f.name])}` | `{_yaml(f.default)}` | {_cell(docs[f.name])} |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the {BEGIN!r} / {END!r} markers are missing")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + section() + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = parser.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        print("docs/configuration.md is up to date" if new == text else "docs/configuration.md is stale: run scripts/gen_config_docs.py")
        return 0 if new == text else 1
    DOC.write_text(new)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
