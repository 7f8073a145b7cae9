"""What the README promises about itself and the repository holds.

- its first lines are the two commands that work on a fresh machine, and CI (.ci/run) runs the
  test command exactly as the README writes it (after the install line the README gives);
- its contents list is its sections, in order, each a real heading;
- every relative link of the README and of docs/ points at a file that exists and, with an
  anchor, at a heading that file has (as GitHub makes anchors);
- every docs/ page is linked from the README's reference table.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_blocks(text: str) -> list[list[str]]:
    """The command lines (comments dropped) of every ```bash block of TEXT, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [[line for line in (re.sub(r"\s+#.*$", "", x).strip() for x in b.splitlines()) if line] for b in blocks]


def ci_lines() -> list[str]:
    text = (ROOT / ".ci" / "run").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_opens_with_the_fresh_machine_commands() -> None:
    head = README[:README.index("\n## ")]
    first = bash_blocks(head)[0]
    assert first == ["scripts/demo", "scripts/test"], first
    assert README.index("```bash") < 20, "the two commands are the README's first lines"
    for line in first:
        assert (ROOT / line).is_file(), f"{line} is not in the repository"


def test_ci_runs_the_readmes_test_command_as_written() -> None:
    """.ci/run does not read the README: this holds them to the same line."""
    test_command = bash_blocks(README)[0][1]
    ci = ci_lines()
    assert test_command in ci, f".ci/run does not run `{test_command}`: {ci}"
    install = [line for line in bash_blocks(README)[1] if line.startswith("scripts/setup --tests")]
    assert install and install[0] in ci, "the README's `scripts/setup --tests` is what .ci/run installs with"
    assert ci.index(install[0]) < ci.index(test_command)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_the_contents_list_is_the_readmes_sections() -> None:
    contents = re.findall(r"^\d+\. \[(.+?)\]\(#(.+?)\)$", README, re.MULTILINE)
    sections = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert [f"{i}. {title}" for i, (title, _) in enumerate(contents, 1)] == sections
    assert [anchor for _, anchor in contents] == [slug(s) for s in sections]


def test_every_link_points_at_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert slug("## `consumer launch`: one command per node".lstrip("# ")) == "consumer-launch-one-command-per-node"


def test_every_docs_page_is_in_the_reference_table() -> None:
    reference = README[README.index("## 8. Reference"):]
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in reference, f"docs/{page.name} is not in the README's reference table"


def test_every_redis_the_docs_start_listens_on_this_host_only() -> None:
    """A `redis-server` the README or docs/ tell a user to start binds 127.0.0.1: a by-hand Redis with
    no password on every interface is open to the network (the demo binds 127.0.0.1 too)."""
    started = [(page.name, line) for page in PAGES for block in bash_blocks(page.read_text())
               for line in block if line.startswith("redis-server")]
    assert started, "the README starts a Redis by hand: this test must see it"
    for name, line in started:
        assert "--bind 127.0.0.1" in line, f"{name}: {line}"
