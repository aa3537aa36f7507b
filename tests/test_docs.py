"""The documentation against the code: every command of ``python -m mxfp4x`` is in the
README, every ``MXFP4X_*`` variable the code reads from the environment is in
docs/contributing.md, every relative link of the README and docs/ points to a file that
exists, and the README stays a short user's page without issue numbers.

Skipped when the checkout's files are absent (the suite run against an installed wheel
from outside the checkout)."""
import argparse
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
CONTRIBUTING = os.path.join(DOCS, "contributing.md")

pytestmark = pytest.mark.skipif(
    not (os.path.isfile(README) and os.path.isdir(os.path.join(ROOT, "mxfp4x"))),
    reason="needs the source checkout (README.md, mxfp4x/)")

README_MAX_LINES = 280


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _doc_files():
    names = sorted(n for n in os.listdir(DOCS) if n.endswith(".md")) if os.path.isdir(
        DOCS) else []
    return [README] + [os.path.join(DOCS, n) for n in names]


# ---- (a) every command in the README ------------------------------------------------------

# where the parser is built: the cli package once the commands live there, else __main__;
# a function returning a parser, or a (parser, ...) tuple
_PARSER_BUILDERS = [("mxfp4x.cli", "build_parser"), ("mxfp4x.cli", "_parser"),
                    ("mxfp4x.cli", "parser"), ("mxfp4x.__main__", "build_parser"),
                    ("mxfp4x.__main__", "_parser")]


def _parser():
    tried = []
    for module_name, function in _PARSER_BUILDERS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # the module exists but one of its imports is broken
            tried.append(f"{module_name} (no such module)")
            continue
        build = getattr(module, function, None)
        if not callable(build):
            tried.append(f"{module_name}.{function} (absent)")
            continue
        made = build()
        candidates = made if isinstance(made, tuple) else (made,)
        for parser in candidates:
            if isinstance(parser, argparse.ArgumentParser):
                return parser
        tried.append(f"{module_name}.{function} (returned no ArgumentParser)")
    pytest.fail("cannot find the argparse parser of python -m mxfp4x; tried " +
                ", ".join(tried))


def _commands():
    parser = _parser()
    for action in parser._actions:  # argparse keeps its sub-parsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    pytest.fail("the parser of python -m mxfp4x has no sub-commands")


def test_commands_are_found():
    commands = _commands()
    assert "bench" in commands and "info" in commands, commands


def test_every_command_is_in_the_readme():
    text = _read(README)
    missing = [cmd for cmd in _commands()
               if not re.search(r"-m mxfp4x \[?" + re.escape(cmd) + r"(?![\w-])", text)]
    assert not missing, (f"README.md does not show these commands as `python -m mxfp4x "
                         f"<command>`: {missing}")


# ---- (b) every environment variable in docs/contributing.md -------------------------------

_SOURCE_DIRS = ["mxfp4x", "include", "tests", "benchmarks", "scripts", ".ci"]
_SOURCE_FILES = ["setup.py"]
_CODE_SUFFIXES = (".py", ".pyx", ".pxd", ".pxi", ".pyi", ".h", ".c")
_SHELL_SUFFIXES = (".sh",)
_SHELL_FILES = {os.path.join(".ci", "run")}
_NAME = r"(MXFP4X_[A-Z0-9_]+)"
# reads in Python and C: os.environ.get("X"), os.environ["X"], os.getenv("X"),
# getenv("X"), environ.get('X'), "X" in os.environ
_CODE_READS = [
    re.compile(r"""environ\s*\.\s*get\(\s*["']""" + _NAME),
    re.compile(r"""environ\s*\[\s*["']""" + _NAME),
    re.compile(r"""getenv\(\s*["']""" + _NAME),
    re.compile(r"""["']""" + _NAME + r"""["']\s+(?:not\s+)?in\s+(?:os\.)?environ\b"""),
]
# in shell: ${X...}, $X, and assignments X=... (export X=1, X=1 command, env X=1)
_SHELL_READS = [
    re.compile(r"\$\{?" + _NAME),
    re.compile(r"(?<![\w$])" + _NAME + r"="),
]


def _source_files():
    this = os.path.abspath(__file__)
    for rel in _SOURCE_FILES:
        yield rel
    for top in _SOURCE_DIRS:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "build")]
            for name in files:
                path = os.path.join(folder, name)
                if os.path.abspath(path) == this:
                    continue
                yield os.path.relpath(path, ROOT)


def environment_variables():
    """name -> the files that read it from the environment."""
    found = {}
    for rel in _source_files():
        shell = rel in _SHELL_FILES or rel.endswith(_SHELL_SUFFIXES)
        if not shell and not rel.endswith(_CODE_SUFFIXES):
            continue
        try:
            text = _read(os.path.join(ROOT, rel))
        except (OSError, UnicodeDecodeError):
            continue
        for pattern in _SHELL_READS if shell else _CODE_READS:
            for name in pattern.findall(text):
                found.setdefault(name, set()).add(rel)
    return found


def test_environment_variables_are_found():
    found = environment_variables()
    for name in ("MXFP4X_ISA", "MXFP4X_TEST_SEED", "MXFP4X_THREADS", "MXFP4X_CI_VENV"):
        assert name in found, sorted(found)


def test_every_environment_variable_is_in_contributing():
    text = _read(CONTRIBUTING)
    missing = {name: sorted(files) for name, files in environment_variables().items()
               if not re.search(r"\b" + re.escape(name) + r"\b", text)}
    assert not missing, ("docs/contributing.md's table of environment variables lacks "
                         f"(variable: the files that read it) {missing}")


# ---- (c) relative links point to files that exist ----------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def _without_code(text):
    """The text without fenced code blocks and inline code spans (no links there)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(path):
    text = _without_code(_read(path))
    for target in _LINK.findall(text) + _REFERENCE.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same page
        yield target


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_to_files(path):
    broken = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        if not os.path.exists(resolved):
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)}: links to missing files {broken}"


def test_the_docs_exist():
    for name in ("architecture", "performance", "platforms", "kimi_k3", "expert_parallel",
                 "contributing"):
        assert os.path.isfile(os.path.join(DOCS, name + ".md")), name


# ---- (d) a short README, no issue numbers ------------------------------------------------

_ISSUE = re.compile(r"\b(?:issues?|pull requests?|PRs?)\s*(?:#\s*)?\d+|(?<![\w&])#\d+\b",
                    re.IGNORECASE)


def test_readme_is_short():
    n_lines = len(_read(README).splitlines())
    assert n_lines <= README_MAX_LINES, (f"README.md has {n_lines} lines (at most "
                                         f"{README_MAX_LINES}): move details to docs/")


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_issue_numbers(path):
    text = _read(path)
    if path != README:  # elsewhere only the word: "OMP: Error #15" is a quotation
        found = re.findall(r"\b(?:issues?|pull requests?)\s*(?:#\s*)?\d+", text,
                           re.IGNORECASE)
    else:
        found = [m.group(0) for m in _ISSUE.finditer(text)]
    assert not found, f"{os.path.relpath(path, ROOT)} mentions issue numbers: {found}"
