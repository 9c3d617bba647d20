"""The documentation stays in shape: README short, with the commands users type first; every relative link
pointing at a file (and heading) that exists; every results file the docs name present; and every measured
figure the pages quote found in a committed results file that its paragraph or section names
(untraced_figures says how that is decided). Reads files only (no process launches)."""
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

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


# A figure: a number followed by a unit that a measurement could have produced (a time, a size, a rate, a
# share, a ratio such as 1.8x or x1.98); "a-b unit" and "a / b unit" count both numbers.
NUM = r"\d[\d,]*(?:\.\d+)?"
UNITS = r"ms|us|µs|s|seconds|CPU seconds|min|minutes|h|hours|KiB|MiB|GiB|TiB|KB|kB|MB|GB|TB|[A-Za-z]+/s"
FIGURE = re.compile(
    rf"(?<![\w.])(?P<values>{NUM}(?:(?:-| / ){NUM})?)(?:[ \u00a0](?P<unit>{UNITS})(?![\w/])|(?P<percent>%)|(?P<times>x)(?!\w))"
    rf"|(?<![\w.])x(?P<ratio>\d+\.\d+)(?![\w.])"
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# How a figure in a unit may be written in a results file: the number times one of these (1 where not listed).
SCALES = {"ms": (1, 1000), "us": (1, 1e6), "µs": (1, 1e6), "s": (1, 0.001), "seconds": (1, 0.001), "min": (1, 1 / 60),
          "minutes": (1, 1 / 60), "%": (1, 100), "MiB": (1, 1024), "GiB": (1, 1 / 1024), "GB": (1, 1e-9), "TFLOP/s": (1, 1e-12)}
# A GPU's or a machine's memory as sold ("one 24 GB card", "8 x 80 GB", "16/24/48/80 GB cards", "capped at
# 24 GiB"): hardware named, not measured.
CARD_SIZE = re.compile(r"\b\d+ x \d+ GB\b|\b(?:\d+/)*\d+ GB (?:cards?|GPUs?|machines?)\b|\bcapped at \d+ GiB\b")


def figure_in(value: str, numbers: list[float], scales: tuple[float, ...] = (1, 100, 1000)) -> bool:
    """A quoted figure is in a file when some number there rounds to it at the quoted precision, as written
    or times one of `scales` (a share times 100 is a %, seconds times 1000 are ms)."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    wanted = float(value.replace(",", ""))
    return any(abs(round(x * scale, decimals) - wanted) < 1e-9 for x in numbers for scale in scales)


class Figure(NamedTuple):
    text: str  # as written: "1.8x", "28-32 s", "3.5%"
    values: list[str]
    unit: str  # "%" for a share, "x" for a ratio
    start: int  # where it is in the text it was found in
    end: int


def figures(text: str) -> list[Figure]:
    found = []
    for match in FIGURE.finditer(text):
        if match.group("ratio"):
            values, unit = [match.group("ratio")], "x"
        else:
            values = re.split(r"-| / ", match.group("values"))
            unit = match.group("unit") or match.group("percent") or match.group("times")
        found.append(Figure(match.group(0), values, unit, match.start(), match.end()))
    return found


def column_units(header: str) -> list[str]:
    """The unit each column of a table names in its header ("ms per update" -> "ms"), else the unit of its
    corner cell ("ms per step" over the whole table), "" where none."""
    units = []
    for cell in header.strip().strip("|").split("|"):
        match = re.search(rf"(?<![\w/])(?:{UNITS})(?![\w/])", cell)
        units.append(match.group(0) if match else "")
    return [unit or units[0] for unit in units]


def row_figures(row: str, units: list[str]) -> list[Figure]:
    """A table row's figures: those written with a unit, and each bare number in a column whose header
    names one ("| 973 |" under "ms per update" is 973 ms)."""
    found = figures(row)
    for cell, unit in zip(re.finditer(r"[^|]+", row), units):
        for number in re.finditer(rf"(?<![\w.\-/]){NUM}(?![\w\-/.])", cell.group(0)) if unit else ():
            start, end = cell.start() + number.start(), cell.start() + number.end()
            if not any(f.start <= start < f.end for f in found):
                found.append(Figure(f"{number.group(0)} {unit}", [number.group(0)], unit, start, end))
    return found


class Paragraph(NamedTuple):
    rows: list[str]  # a table's rows, each with its whitespace collapsed; a paragraph's one line of text
    section: str  # the heading it is under
    table: bool

    @property
    def text(self) -> str:
        return " ".join(self.rows)


def paragraphs(markdown: str) -> list[Paragraph]:
    """A Markdown text's paragraphs outside code fences: runs of lines between blank lines, each list item and
    each table one of its own (a heading is one too), with the heading they are under."""
    found, lines, section = [], [], ""

    def close():
        if lines:
            table = all(line.startswith("|") for line in lines)
            rows = [" ".join(line.split()) for line in lines] if table else [" ".join(" ".join(lines).split())]
            found.append(Paragraph(rows, section, table))
            lines.clear()

    for line in outside_code(markdown):
        stripped = line.strip()
        heading = re.match(r"#{1,6}\s+(.*)", stripped)
        if heading:
            close()
            section = heading.group(1)
            found.append(Paragraph([stripped], section, False))
        elif not stripped:
            close()
        else:
            if re.match(r"(?:[-*+]|\d+\.)\s", stripped) or (lines and stripped.startswith("|") != lines[-1].startswith("|")):
                close()
            lines.append(stripped)
    close()
    return found


def results_named(text: str, results: Path) -> list[Path]:
    """The committed results files a text names: as benchmarks/results/NAME (globs and {a,b} spelled out), or
    by a file's bare name (a table of files under a header that says where they are)."""
    bare = re.findall(r"(?<![\w/.\-])(\d{4}-\d\d-\d\d-[\w.\-{},*]+)", text)
    names = named_results(text) | named_results(" ".join("benchmarks/results/" + name for name in bare))
    files = {path for name in names for path in (results.glob(name) if "*" in name else [results / name])}
    files |= {path for path in results.iterdir() if re.search(rf"(?<![\w\-/]){re.escape(path.name)}(?![\w\-])", text)}
    return sorted(path for path in files if path.is_file() and path.name != "README.md")


def is_ratio_of_two(figure: Figure, row: str) -> bool:
    """A ratio (1.8x, x1.10) that is the quotient of two other numbers of its table row or paragraph, at its
    precision ("1.8x faster (1102 -> 613 ms)"): derived from figures checked beside it."""
    if figure.unit != "x":
        return False
    others = [float(n.replace(",", "")) for n in re.findall(rf"(?<![\w.\-/]){NUM}(?![\w\-/])", row[: figure.start] + " " + row[figure.end :])]
    return figure_in(figure.values[0], [a / b for i, a in enumerate(others) for j, b in enumerate(others) if b and i != j], (1,))


def untraced_figures(markdown: str, results: Path, stated: Sequence[str] = ()) -> list[str]:
    """Every figure of a Markdown text that no committed results file supports, as 'figure (why): paragraph'.

    A paragraph's results files are those it names and those named before it under the same heading (so a
    table, or the bullets under an introduction, take the files that introduction names). Each figure must
    be found in one of them (figure_in); a ratio must be the quotient of two numbers beside it instead, since
    a file's thousands of numbers would hold almost any ratio by chance. A measured figure in a paragraph
    with no results file (none in it, none before it under its heading) is untraced: it must name the file it
    came from, or be said without a figure. What passes without a file is a value nobody measured: inside
    one of `stated` (the page's phrases that state a default, a limit, arithmetic or an estimator's output)
    or a card's size (CARD_SIZE). In a table, a bare number under a header that names a unit is a figure
    too. A figure a file holds by chance passes: the check finds figures that are in none of the files named,
    it cannot prove where one came from."""
    untraced, section, section_files, numbers_of = [], None, [], {}
    for paragraph in paragraphs(markdown):
        if paragraph.section != section:
            section, section_files = paragraph.section, []
        section_files += [path for path in results_named(paragraph.text, results) if path not in section_files]
        for path in section_files:
            if path not in numbers_of:
                numbers_of[path] = [float(n) for n in NUMBER.findall(path.read_text(encoding="utf-8", errors="replace"))]
        numbers = [x for path in section_files for x in numbers_of[path]]
        covered = [match.span() for match in CARD_SIZE.finditer(paragraph.text)]
        covered += [match.span() for phrase in stated for match in re.finditer(re.escape(phrase), paragraph.text)]
        header = paragraph.table and len(paragraph.rows) > 2 and re.fullmatch(r"\|[\s:|\-]+\|?", paragraph.rows[1])
        units = column_units(paragraph.rows[0]) if header else []
        offset = 0
        for index, row in enumerate(paragraph.rows):
            for figure in row_figures(row, units if index > 1 else []):
                start, end = offset + figure.start, offset + figure.end
                if any(a <= start and end <= b for a, b in covered) or is_ratio_of_two(figure, row):
                    continue
                if section_files and figure.unit != "x" and all(figure_in(v, numbers, SCALES.get(figure.unit, (1,))) for v in figure.values):
                    continue
                why = f"not in {', '.join(path.name for path in section_files)}" if section_files else "no results file named"
                untraced.append(f"{figure.text} ({why}): {paragraph.text[:90]}...")
            offset += len(row) + 1
    return untraced


# Figures the documents state rather than report (phrases as written, per page): a figure inside one of
# these passes without a results file. Only values nobody measured belong here: a default or limit the code
# sets, a specification, arithmetic from sizes and counts, a test's tolerance, a prediction of
# --estimate_speed or an estimate of --estimate_memory for the settings named beside it (worked out by the
# command, not measured), advice. A measurement goes in a results file instead.
STATED: dict[str, list[str]] = {
    "README.md": [
        "predicted 1.60 img/s per GPU, 1.60 for the job", "predicted 1.56 img/s per GPU, 3.13 for the job", "x1.98 over one card",
        "predicted 9.06 img/s per GPU, 72.51 for the job", "predicted 8.36 img/s per GPU, 267.48 for the job",
        "InfiniBand 400 Gb/s per GPU; x31.49", "(x1.86-x1.98 over one card)", "chipset x4 slot (x1.15)",
        # --estimate_speed's predictions (tests/estimates/test_speed_estimate.py compares the table's with the estimator)
        "18.4 / 27.4 GiB (estimated)",  # --estimate_memory
        "on cards under 40 GB", "+10% and 2.5 GiB on one GPU, +35% and 2.5 GiB on several",  # the code's threshold and margin
    ],
    "benchmarks/README.md": [
        "(21 GB: an fp32 base, an fp16 tuned copy", "SDXL-sized items (450 KB)", "512 items in 57 MB shards",  # what the benchmarks make
        "at 30-50 ms a request",  # an object store's latency, assumed
        "at most 9.5 minutes", "every 100 ms",  # the battery's limit and sampling interval
    ],
    "docs/caching.md": ["in 8 MB requests"],  # the scan's request size
    "docs/checkpoints.md": [
        "more than 3 s later", "within 3 s counts", "plain torchrun waits 30 s",  # the trainer's and torchrun's limits
        "Docker's default 64 MB",  # Docker's documented default --shm-size
        "each save 2.3 GB",  # arithmetic: 225 M parameters x (4 bytes of weights + 4 of EMA + about 2 of 8-bit moments)
    ],
    "docs/design.md": [
        # arithmetic from SDXL's sizes and parameter counts, and the share of values counted by splitting its tensors
        "UNet (5.1 GB)", "about 470 MB of the", "about 40 GB: fp32 weights", "needs about 10 ms at 4 TB/s",
        "about 25.7 GB for SDXL's 2.57 B parameters, so about 12.8 GB (12.0 GiB) per GPU",
        "0.04-0.06% of SDXL's values on 1, 2, 4, 8 or 16 GPUs, 0.47% on 32, but 2.5% on 3 GPUs and 3.5% on 6, 12 or 24",
        "weights take 1.6 GB in bf16", "state each: 8.2 GB over all", "about 1.1 GB in bf16 at batch 8", "save 1.6 GB x (N-1)/N",
        "state (8.2 GB for both", "always downloads 3.9 GB",
        # FLOP counted by the benchmark (bench_caption_mode.py) on the meta device
        "forward is 0.44% of the UNet's", "0.87% at 150 tokens, 1.31% at 225", "caption, 1.3% of the UNet's",
        # tolerances and settings of the tests
        "at least 99.99% of the 8-bit codes", "(at most 0.1% of them", "updates of 1.3% of a bf16 step", "within 1% where rounding",
        "taken over after 5 minutes unrenewed", "(the first 256 KiB",  # the object store's lease and header read
    ],
    "docs/exporting.md": [
        # sizes worked out from the models' parameter counts and the LoRA's shapes
        "a whole 6.9 GB model", "(about 170 MB at rank 32", "43 MB at 8, 85 MB at 16, 170 MB at 32, 340 MB at 64, 680 MB at 128",
        "+16% at the same rank", "(base in fp32, 14 GB,", "tuned in fp16, 7 GB,", "comparing all 21 GB", "in fp32, about 28 GB",
        "more than 50% of their weights' norm", "sqrt(2) = 141%",  # the warning's threshold, and why
    ],
    "docs/flags.md": [  # help texts: advice, arithmetic, thresholds
        "use a 3-10x lower --learning_rate", "every GPU: 1.6 GB in bf16", "about 8 GB more over all GPUs",
        "fp32 gradient, 10.3 GB for SDXL", "GPUs under 40 GB", "about 30% more compute", "cards (16/24/48/80 GB)",
    ],
    "docs/gpu_results.md": [
        "within 90 s", "within 170 s", "gives it 300 s now",  # the check's time limits then and now
    ],
    "docs/memory.md": [
        "2.5 GiB and 10% of the tracked peak on one GPU, 35% on several", "within 97% of its size",  # the margin and fit rule
        # --estimate_memory's estimates for the settings named beside them
        "(about 24 GiB for SDXL on one GPU", "needs 18.9 GiB tracked, 28.0 GiB with the margin",
        "20.9 GiB tracked, 30.7 GiB with the margin", "about 5 GiB each and moments 9.56 GiB", "part of the 0.5 GiB of activations",
        "it was 23.9 / 34.8 GiB, that step's 4.78 GiB temporary", "25.8 GiB tracked, 30.9 GiB with the margin", "alone 9.56 GiB each",
        "need 10.4 / 16.5 GiB",
        # arithmetic from SDXL's parameter count, and the automatic choice's threshold
        "(about 7 GB in bf16)", "fp32 gradient, 10.3 GB for SDXL", "GPUs under 40 GB", "(25.7 GB for SDXL",
    ],
    "docs/object_storage.md": [  # the code's timeouts and lease, and the longest a stalled read can take by them
        "younger than 5 minutes", "stalled past 5 minutes", "connect timeout of 10 s and a read timeout of 15 s", "some 3.2 minutes",
        "within 15 s\"", "after 10 minutes without a batch",
    ],
    "docs/speed.md": [
        "400 Gb/s per GPU", "H100 / H200 989, A100 312, RTX 4090 165, RTX 3090 71 TFLOP/s",  # published specifications
        "(82% measured by nccl-tests on NVLink 4; 70-90% assumed",  # the link shares speed_estimate.LINKS cites
        "more than 15% of the update",  # when the estimate suggests changes
        # --estimate_speed's predictions for the settings named beside them
        "| 22 GB/s | 5115 ms | 3.13 | x1.98 |", "| 11 GB/s | 5422 ms | 2.95 | x1.86 |", "| 5.5 GB/s | 8774 ms | 1.82 | x1.15 |",
        "moves 38 GiB of bf16", "(about 6x an H200's time)", "card adds 15%", "1.38 img/s for the job, x2.00", "1.60 img/s predicted",
        "gives x1.96 over that config (x1.84 at 11 GB/s)",
        "20.5 GB gathered per update",  # counted by the test of the collectives' bytes
    ],
    "docs/training.md": [
        "(32 MiB)", "(1 GiB)", "default 600 s", "SIGTERM 10 minutes before",  # train.sh's and slurm_train.sh's settings
        "10% of the items are held out", "30% of them a third time", "use a 3-10x lower learning rate",  # defaults, an example, advice
        # arithmetic from the encoders' and the UNet's parameter counts; FLOP counted (design.md §10)
        "every GPU: 1.6 GB in bf16", "forward is 0.44% of the", "about 8.2 GB more over all GPUs with adamw8bit (4.1 GB each on 2)",
        "4.8 GiB each instead of 9.6",
        # each optimizer's state for the full-size UNet, made by the optimizers' own code (tests/optimizers/test_optimizers.py)
        "4.86 GiB", "19.13 GiB", "0.02 GiB", "9.56 GiB", "9.59 GiB", "38.26 GiB",
    ],
    "docs/troubleshooting.md": ["wait up to 30 s", "about 7 GB more for a pipeline copy"],  # a limit; arithmetic
    "docs/validation.md": ["(about 7 GB in bf16)", "10% + 10% holds out 10%, not 20%", "always downloads 3.9 GB"],
    "tests/README.md": ["more than about 4 s on 2 cores", "8x VAE"],  # the slow marker's bound; the VAE's downscaling
}


def test_every_figure_the_documents_quote_is_traced_to_a_results_file():
    pages = {str(page.relative_to(REPO_ROOT)): page for page in documents()}
    stale = [f"{name}: {phrase!r}" for name, phrases in STATED.items() for phrase in phrases
             if name not in pages or phrase not in " ".join(pages[name].read_text(encoding="utf-8").split())]
    assert stale == [], "STATED lists phrases its pages no longer hold (drop them):\n" + "\n".join(stale)
    untraced = []
    for page in documents():
        name = str(page.relative_to(REPO_ROOT))
        untraced += [f"{name}: {figure}" for figure in untraced_figures(page.read_text(encoding="utf-8"), RESULTS, STATED.get(name, []))]
    assert untraced == [], (
        "figures no committed results file supports (name the file in the paragraph, or in the section above a table; "
        "a value nobody measured goes in STATED):\n" + "\n".join(untraced)
    )


def test_the_figure_check_traces_figures_to_the_files_a_paragraph_or_its_section_names(tmp_path):
    (tmp_path / "2026-01-02-cpu-step.log").write_text("$ bench\nstep 0.0934 s, first 12.26 s, peak 3.21 GiB\n")
    named = "`benchmarks/results/2026-01-02-cpu-step.log`"
    assert untraced_figures(f"A step took 93 ms, 12.3 s at first, 3.21 GiB at the peak ({named}).", tmp_path) == []
    assert [f.split(" (")[0] for f in untraced_figures(f"A step took 95 ms and 7.5% of it waits ({named}).", tmp_path)] == ["95 ms", "7.5%"]
    # A table, or the bullets under an introduction, take the files named before them under the same heading.
    section = f"## Step\n\nMeasured ({named}):\n\n| path | ms per step |\n|---|---|\n| ours | 93 |\n| theirs | 99 |\n\n- at first 12.26 s\n- later 1 min\n"
    assert [f.split(" (")[0] for f in untraced_figures(section, tmp_path)] == ["99 ms", "1 min"]
    assert "no results file named" in untraced_figures(section + "\n## Other\n\nIt took 93 ms.\n", tmp_path)[-1]


def test_the_figure_check_fails_a_measured_figure_without_a_results_file_and_passes_stated_values(tmp_path):
    text = "On 2 cores an update took 24 ms against 53-57 ms (benchmarks/bench_optimizer_step.py).\n"
    assert [f.split(" (")[0] for f in untraced_figures(text, tmp_path)] == ["24 ms", "53-57 ms"]
    stated = "Every request has a read timeout of 15 s; one 24 GB card, 8 x 80 GB, capped at 24 GiB; it took 3 s.\n"
    assert [f.split(" (")[0] for f in untraced_figures(stated, tmp_path, ["read timeout of 15 s"])] == ["3 s"]
    assert untraced_figures("```text\n5115 ms per update\n```\n", tmp_path) == []  # output shown as an example
    # A ratio passes only as the quotient of two numbers beside it.
    assert untraced_figures("It made the update 1.8x faster (1102 -> 613 per update).\n", tmp_path) == []
    assert [f.split(" (")[0] for f in untraced_figures("It made the update 2.5x faster (1102 -> 613 per update).\n", tmp_path)] == ["2.5x"]
