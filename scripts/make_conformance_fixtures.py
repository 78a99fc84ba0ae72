"""Copy the fixed conformance slice used by tests/test_conformance.py from ../shared/data into tests/fixtures.

maskbench: every STEP[file]-th schema of each file (by line order) whose line is at most 4 KB; JSON-Schema-Test-Suite
(draft 2020-12): the files listed in TEST_SUITE_FILES, verbatim. Usage: ``python scripts/make_conformance_fixtures.py``.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "tests" / "fixtures" / "conformance"
STEP, MAX_LINE = {"bfcl": 16, "github": 8, "glaive": 32, "other": 4}, 4096
TEST_SUITE_FILES = ["additionalProperties", "allOf", "anyOf", "const", "enum", "items", "maxItems", "minItems",
                    "maxLength", "minLength", "maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum",
                    "multipleOf", "oneOf", "pattern", "patternProperties", "prefixItems", "properties", "ref",
                    "required", "defs", "boolean_schema", "default"]


def main(argv: list[str] | None = None) -> int:
    (OUT / "maskbench").mkdir(parents=True, exist_ok=True)
    for path in sorted((DATA / "maskbench").glob("*.jsonl")):
        lines = [ln for i, ln in enumerate(path.read_text().splitlines()) if i % STEP[path.stem] == 0 and len(ln) <= MAX_LINE]
        (OUT / "maskbench" / path.name).write_text("\n".join(lines) + "\n")
    ts = OUT / "json-schema-test-suite" / "draft2020-12"
    ts.mkdir(parents=True, exist_ok=True)
    for name in TEST_SUITE_FILES:
        shutil.copyfile(DATA / "json-schema-test-suite" / "draft2020-12" / f"{name}.json", ts / f"{name}.json")
    shutil.copyfile(DATA / "json-schema-test-suite" / "LICENSE.MIT.txt", OUT / "json-schema-test-suite" / "LICENSE.MIT.txt")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT}: {size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
