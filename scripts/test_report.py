"""The test report that scripts/test.sh prints: counts per suite, per run, and one summary line.

    python3 scripts/test_report.py DIR RUN...

For each RUN, DIR holds ``RUN.rc`` (its exit status) and its machine-readable results: ``RUN.json``
from a mocha run (scripts/mocha-report.cjs) or ``RUN.xml`` from a pytest run (``--junitxml``, family
xunit1). A run with neither (tsc) has only its exit status. A suite is a top-level ``describe`` of a
mocha test file, or a pytest file.

Columns: passed, failed, skipped (mocha's pending), errored: the tests that did not run because their
suite errored (a failed ``before``/``beforeEach`` hook, a pytest fixture's setup, a file that failed
to collect); an error that kept no test from running (an ``after`` hook) counts 1. A run that exited
non-zero with nothing failed or errored counts 1 errored, and so does a run that left no results.
The last line, ``tests: N passed, N failed, N skipped``, counts errored as failed. Exits 1 when
anything failed or errored, else 0. Standard library only.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

MAX_DETAILS = 5  # skipped tests or errors listed under a suite


@dataclass
class Counts:
    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errored: int = 0
    details: list[str] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.errored += other.errored


def first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


def cause(text: str | None) -> str:
    """The error line of a pytest report (its last ``E   ...`` line), else its first line."""
    lines = (text or "").strip().splitlines()
    errs = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return errs[-1] if errs else first_line(text)


def listed(details: list[str], prefix: str) -> list[str]:
    out = [f"{prefix}: {d}" for d in details[:MAX_DETAILS]]
    if len(details) > MAX_DETAILS:
        out.append(f"{prefix}: ... and {len(details) - MAX_DETAILS} more")
    return out


def mocha_suites(path: Path) -> list[Counts]:
    suites = []
    for s in json.loads(path.read_text())["suites"]:
        c = Counts(f"{s['file']}: {s['title']}", s["passed"], s["failed"], s["pending"])
        errors = []
        for e in s["errors"]:
            c.errored += max(1, e["notRun"])
            errors.append(f"{e['what']}: {e['message']} ({tests(e['notRun'])} did not run)")
        c.details = listed(errors, "errored") + listed(s["pendingTitles"], "skipped")
        suites.append(c)
    return suites


def python_file(dotted: str) -> str:
    """workers.python.tests.test_x(.Class) -> workers/python/tests/test_x.py where that file exists."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        candidate = "/".join(parts[:n]) + ".py"
        if Path(candidate).is_file():
            return candidate
    return dotted


def pytest_suites(path: Path) -> list[Counts]:
    by_file: dict[str, Counts] = {}
    skipped: dict[str, list[str]] = {}
    errors: dict[str, dict[str, int]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = case.get("file") or python_file(classname or name)
        c = by_file.setdefault(file, Counts(file))
        failure, error, skip = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None and not (error.get("message") or "").startswith("failed on teardown"):
            # Collection (no classname: the file's tests did not run) or a fixture's setup.
            c.errored += 1
            if classname:
                detail = f"{error.get('message') or 'error'} ({{n}} did not run)"
            else:
                detail = f"collection failed: {cause(error.text)} (the file's tests did not run)"
            errors.setdefault(file, {})
            errors[file][detail] = errors[file].get(detail, 0) + 1
        elif failure is not None or error is not None:
            c.failed += 1
        elif skip is not None:
            c.skipped += 1
            skipped.setdefault(file, []).append(f"{name}: {skip.get('message', '')}")
        else:
            c.passed += 1
    for file, c in by_file.items():
        errs = [d.replace("{n}", tests(n)) for d, n in errors.get(file, {}).items()]
        c.details = listed(errs, "errored") + listed(skipped.get(file, []), "skipped")
    return list(by_file.values())


def report(results: Path, runs: list[str]) -> int:
    runs_total: list[tuple[str, Counts]] = []
    suites: list[tuple[str, Counts]] = []
    for run in runs:
        rc_file = results / f"{run}.rc"
        rc = int(rc_file.read_text().strip()) if rc_file.is_file() else None
        total = Counts(run)
        parsed: list[Counts] | None = None
        if (results / f"{run}.json").is_file():
            parsed = mocha_suites(results / f"{run}.json")
        elif (results / f"{run}.xml").is_file():
            parsed = pytest_suites(results / f"{run}.xml")
        for s in parsed or []:
            total.add(s)
            suites.append((run, s))
        if parsed is None and run != "tsc":
            total.errored += 1
            total.details.append("left no results: it stopped before running its tests (see its output above)")
        elif rc is None or (rc != 0 and total.failed + total.errored == 0):
            total.errored += 1
            total.details.append(f"exited {rc} with no failed test counted (see its output above)")
        runs_total.append((run, total))

    head = f"{'run':<16} {'passed':>7} {'failed':>7} {'skipped':>7} {'errored':>7}"
    pad = " " * (len(head) + 2)
    print()
    print("Per suite (errored: tests that did not run because a hook, a fixture's setup or collection failed)")
    print(f"{head}  suite")
    for run, s in suites:
        print(f"{run:<16} {s.passed:>7} {s.failed:>7} {s.skipped:>7} {s.errored:>7}  {s.name}")
        for d in s.details:
            print(f"{pad}{d}")
    print()
    print("Per run")
    print(head)
    for run, t in runs_total:
        print(f"{run:<16} {t.passed:>7} {t.failed:>7} {t.skipped:>7} {t.errored:>7}")
        for d in t.details:
            print(f"{pad}{d}")
    grand = Counts("all")
    for _, t in runs_total:
        grand.add(t)
    print(f"tests: {grand.passed} passed, {grand.failed + grand.errored} failed, {grand.skipped} skipped")
    return 1 if grand.failed + grand.errored else 0


if __name__ == "__main__":
    sys.exit(report(Path(sys.argv[1]), sys.argv[2:]))
