"""The README stays a front door and docs/ stays true to the CLI: generated option tables, pages, links, size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from t5compress.cli import app, docgen

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
COMMANDS = list(docgen.commands())
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = _slug(m[1])
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("name", COMMANDS)
def test_options_block_equals_what_the_cli_renders_now(name):
    page = DOCS / f"{docgen.page_of(name)}.md"
    assert page.exists(), f"command '{name}' has no docs page {page.relative_to(ROOT)}"
    block = docgen.blocks(page.read_text()).get(name)
    assert block is not None, f"{page.relative_to(ROOT)} has no '<!-- options:start {name} -->' block"
    assert block == docgen.render(name), f"{page.relative_to(ROOT)}: options of '{name}' are stale; run `make docs`"


def test_each_generated_block_is_one_command_on_its_own_page():
    found: dict[str, list[str]] = {}
    for page in sorted(DOCS.glob("*.md")):
        for name in docgen.blocks(page.read_text()):
            found.setdefault(name, []).append(page.stem)
    assert set(found) == set(COMMANDS)
    assert {name: pages for name, pages in found.items() if pages != [docgen.page_of(name)]} == {}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_help_is_in_the_docs_table(name):
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    shown = set(re.findall(r"^│\s+(?:\*\s+)?(--[\w-]+)", result.output, flags=re.MULTILINE))
    assert "--help" in shown
    block = docgen.blocks((DOCS / f"{docgen.page_of(name)}.md").read_text())[name]
    documented = set(re.findall(r"`(--[\w-]+)`", block))
    assert shown <= documented, f"in `{name} --help` but not in its docs table: {sorted(shown - documented)}"


def test_every_command_has_a_row_linking_its_page_in_the_readme_table():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| [`")]
    for name in COMMANDS:
        link = f"[`{name}`](docs/{docgen.page_of(name)}.md"
        assert any(row.startswith(f"| {link}") for row in rows), f"README's command table has no row for '{name}'"
    assert len(rows) == len(COMMANDS), "README's command table has a row for a command the CLI does not have"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: broken links {broken}"


def test_readme_is_at_most_15_kb():
    size = len(README.read_bytes())
    assert size <= 15 * 1024, f"README.md is {size} bytes; reference belongs in docs/"


def test_docgen_check_reports_a_stale_block_and_update_rewrites_it(tmp_path):
    page = tmp_path / "info.md"
    page.write_text("# info\n\n<!-- options:start info -->\nold table\n<!-- options:end -->\n\nafter\n")
    assert docgen.update(tmp_path, check=True) == ["info"]
    assert "old table" in page.read_text()
    assert docgen.update(tmp_path) == ["info"]
    assert page.read_text() == f"# info\n\n{docgen.render('info')}\n\nafter\n"
    assert docgen.update(tmp_path, check=True) == []
