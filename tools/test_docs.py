"""The repository's docs stand alone: package READMEs link only to absolute URLs (they are the
package index's pages), every link into the canonical repository names a file that exists, no
doc cites a file the repository lacks, and the root README's install command works as shown."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from check_packaging import DISTRIBUTIONS, REPOSITORY, ROOT, members  # noqa: E402

# Once cited by the noxfile and tools; spelled in two parts so that this file does not cite it.
MISSING = "ARCHITECTURE" + ".md"
LINK = re.compile(r"\]\(([^)\s]+)\)|<(https?://[^>\s]+)>")


def _links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(path.read_text())]


def test_package_readmes_link_only_to_absolute_urls():
    for folder in members():
        readme = folder / "README.md"
        relative = [u for u in _links(readme) if not u.startswith(("https://", "http://", "#"))]
        assert not relative, (
            f"{readme.relative_to(ROOT)}: relative links break on the index: {relative}"
        )


def test_links_into_the_repository_name_files_that_exist():
    docs = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *(f / "README.md" for f in members())]
    checked = 0
    for doc in docs:
        for url in _links(doc):
            match = re.fullmatch(
                re.escape(REPOSITORY) + r"/(?:blob|tree)/main/([^#?]+)(?:#.*)?", url
            )
            if match:
                assert (ROOT / match.group(1)).exists(), f"{doc.relative_to(ROOT)} links to {url}"
                checked += 1
    assert checked >= 1  # titan-parallel's guide at least


def test_docs_cite_only_files_the_repository_has():
    texts = [
        *ROOT.glob("*.md"),
        *ROOT.glob("docs/*.md"),
        ROOT / "noxfile.py",
        *ROOT.glob("tools/*.py"),
        *(f / "README.md" for f in members()),
    ]
    for path in texts:
        text = path.read_text()
        assert MISSING not in text, f"{path.relative_to(ROOT)} cites {MISSING}, not in the repo"
        for cited in re.findall(r"\bdocs/[\w./-]+\.md\b", text):
            assert (ROOT / cited).is_file() or (path.parent / cited).is_file(), (
                f"{path.relative_to(ROOT)} cites {cited}, which does not exist"
            )
    assert "docs/architecture.md" in (ROOT / "noxfile.py").read_text()
    assert "docs/architecture.md" in (ROOT / "tools/check_declared_deps.py").read_text()


def test_root_readme_install_command_works_as_shown(tmp_path):
    uv = shutil.which("uv")
    assert uv, "uv is not on PATH; the README's commands need it (see the README's set-up)"
    readme = (ROOT / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("uv sync")]
    command = shlex.split(line.split("#")[0])
    # Exactly the README's command, into a scratch environment rather than the workspace's own.
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "env")}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    python = tmp_path / "env" / "bin" / "python"
    found = subprocess.run(
        [str(python), "-c", 'import titan_data; print(titan_data.find_tokenizer_model("llama3"))'],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().endswith("tokenizer.model")


# `pip install titan-x`, `'titan-x[extra]'`, `titan-x>=0.1`: a distribution named where a user
# would install it from.
INSTALLED_NAME = re.compile(
    r"pip install ['\"]?(titan[\w.-]*)|(?<![\w/.-])(titan-[\w-]+)(?:\[\w+\]|>=|==)"
)


# (file, name) named on purpose: the Packaging section shows the pin that was a hole.
FOREIGN_ON_PURPOSE = {("docs/architecture.md", "titan-core")}


def _install_mentions(text: str) -> list[str]:
    return [a or b for a, b in INSTALLED_NAME.findall(text)]


def test_install_instructions_name_only_titans_own_distributions():
    """A stale `pip install titan-parallel` would install whatever someone else uploads under
    that name (docs/architecture.md, "Names on the package index")."""
    assert _install_mentions("pip install titan-parallel and 'titan-trainer[ft]'") == [
        "titan-parallel",
        "titan-trainer",
    ]
    assert _install_mentions("pip install 'titan-llm-data[llama]'; titan-llm-core>=0.1") == [
        "titan-llm-data",
        "titan-llm-core",
    ]
    files = [
        *ROOT.glob("*.md"),
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("bench/*.md"),
        *(p for f in members() for p in f.rglob("*") if p.suffix in (".md", ".py", ".toml")),
    ]
    wrong = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        if ".venv" not in path.parts
        for name in _install_mentions(path.read_text())
        if name not in DISTRIBUTIONS
        and (str(path.relative_to(ROOT)), name) not in FOREIGN_ON_PURPOSE
    ]
    assert not wrong, "install names that are not Titan's distributions:\n" + "\n".join(wrong)


def test_what_the_readme_commands_write_is_ignored_by_git():
    """A command a README shows, typed at the repository's root, leaves nothing for `git
    status` to show: every folder it writes (`--out`, `--job.dump_folder`, a dump folder's
    `outputs/`) is ignored."""
    readmes = [ROOT / "README.md", ROOT / "bench/README.md", *(f / "README.md" for f in members())]
    written = set()
    for readme in readmes:
        for line in _shell_lines(readme.read_text()):
            for flag in ("--out", "--job.dump_folder"):
                written.update(re.findall(rf"{flag}[ =](\S+)", line))
    written = {w for w in written if not w.startswith(("/", "$", "<", "DIR", "OUT"))}
    assert "tokens/pydocs" in written and "outputs/ranger21" in written, sorted(written)
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *(f"{w}/a-file" for w in sorted(written))],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    ignored = {line.removesuffix("/a-file") for line in done.stdout.splitlines()}
    assert ignored == written, f"not ignored by git: {sorted(written - ignored)}"


def _shell_lines(markdown: str) -> list[str]:
    """The lines of a document's shell blocks (```bash, ```sh, or a fence naming no language)."""
    lines, language = [], None
    for line in markdown.splitlines():
        if line.startswith("```"):
            language = line[3:].strip() if language is None else None
            continue
        # A command, not the output a block shows (`titan: error: ...`, indented lines).
        command = re.match(r"[\w./-]+[ =]", line) and not line.startswith(("titan: ", "step "))
        if language in ("bash", "sh", "") and command:
            lines.append(line)
    return lines
