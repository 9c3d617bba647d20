"""The documentation stays in shape: README short, with the commands users type first; every relative link
pointing at a file (and heading) that exists; every results file the docs name present; and every figure
README quotes beside a results file found in that file. Reads files only (no process launches)."""
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
RESULTS = REPO_ROOT / "benchmarks" / "results"
FIRST_SCREEN = 40
README_MAX_LINES = 300


def documents() -> list[Path]:
    """README.md, docs/*.md, tests/README.md and benchmarks/README.md: every page a user is sent to."""
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "tests" / "README.md", REPO_ROOT / "benchmarks" / "README.md"]


def outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside ``` fences (links there are not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces as -."""
    anchors: set[str] = set()
    for line in outside_code(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        anchor, count = slug, 1
        while anchor in anchors:
            anchor, count = f"{slug}-{count}", count + 1
        anchors.add(anchor)
    return anchors


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[str]:
    targets = []
    for line in outside_code(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
        targets += [t for t in LINK.findall(line) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    return targets


def test_readme_is_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_starts_with_the_quick_start_and_the_tests():
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])
    for command in ("bash quickstart.sh", "bash run_tests.sh --quick"):
        assert command in first_screen, f"README's first {FIRST_SCREEN} lines lack `{command}`"
    full_suite = re.search(r"^bash run_tests\.sh(\s+#|\s*$)", first_screen, re.MULTILINE)
    assert full_suite, f"README's first {FIRST_SCREEN} lines lack `bash run_tests.sh` (the full suite)"


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in documents():
        for target in relative_links(page):
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert broken == [], "broken links:\n" + "\n".join(broken)


def named_results(text: str) -> set[str]:
    """The benchmarks/results/ file names a text mentions, with {a,b} spelled out; DATE / YYYY templates skipped."""
    names = set()
    for name in re.findall(r"benchmarks/results/([\w.\-{},*]+)", text):
        name = name.rstrip(".,")
        if not name or "DATE" in name or "YYYY" in name:
            continue
        expanded = [name]
        while any("{" in n for n in expanded):
            n = next(n for n in expanded if "{" in n)
            expanded.remove(n)
            head, rest = n.split("{", 1)
            options, tail = rest.split("}", 1)
            expanded += [head + option + tail for option in options.split(",")]
        names.update(expanded)
    return names


def test_every_results_file_the_docs_name_exists():
    missing = []
    for page in documents():
        for name in sorted(named_results(page.read_text(encoding="utf-8"))):
            found = list(RESULTS.glob(name)) if "*" in name else [RESULTS / name] if (RESULTS / name).is_file() else []
            if not found:
                missing.append(f"{page.relative_to(REPO_ROOT)}: benchmarks/results/{name}")
    assert missing == [], "named but not committed:\n" + "\n".join(missing)


QUOTED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?: (images/s|TFLOP/s|ms|s|GiB)(?![\w/])|(%))")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def figure_in(value: str, numbers: list[float]) -> bool:
    """A quoted figure is in a file when some number there rounds to it at the quoted precision, as written
    (GiB, s, images/s), as a share times 100 (%) or as seconds times 1000 (ms)."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    wanted = float(value.replace(",", ""))
    return any(abs(round(x * scale, decimals) - wanted) < 1e-9 for x in numbers for scale in (1, 100, 1000))


def test_figures_readme_quotes_from_a_results_file_are_in_that_file():
    """Only lines that name a results file are checked, and only numbers followed by a unit (ms, s, GiB, %,
    images/s, TFLOP/s); a figure must be found in one of the files that line names."""
    unsupported = []
    for line in README.read_text(encoding="utf-8").splitlines():
        files = [RESULTS / name for name in named_results(line) if "*" not in name and (RESULTS / name).is_file()]
        if not files:
            continue
        numbers = [float(n) for f in files for n in NUMBER.findall(f.read_text(encoding="utf-8"))]
        for value, unit, percent in QUOTED.findall(line):
            if not figure_in(value, numbers):
                unsupported.append(f"{value} {unit or percent} not in {', '.join(f.name for f in files)}")
    assert unsupported == [], "README quotes figures its results files do not hold:\n" + "\n".join(unsupported)
