"""Print the failed and erroring tests of a JUnit XML report, one line each, for the tail of CI's log.

Usage: python .ci/failed_tests.py REPORT.xml

CI's log is read from its end: pytest's own summary can be missing there (an INTERNALERROR skips it)
or scrolled away by later output. Each line is ``FAILED|ERROR <module.Class>::<test> - <first line of the message>``.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(report: str) -> int:
    path = Path(report)
    if not path.exists():
        print(f"[ci] no test report at {path} (pytest ended before writing it)")
        return 0
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind, label in (("failure", "FAILED"), ("error", "ERROR")):
            for problem in case.findall(kind):
                message = (problem.get("message") or problem.text or "").strip().splitlines()
                first = message[0][:160] if message else ""
                rows.append(f"{label} {case.get('classname')}::{case.get('name')} - {first}")
    print(f"[ci] {len(rows)} failed or erroring tests (from {path}):")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
