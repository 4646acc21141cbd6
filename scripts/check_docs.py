#!/usr/bin/env python3
"""The user pages' commands and links, checked against the repository (a ctest test).

    scripts/check_docs.py [ROOT]

Pages: README.md, CONTRIBUTING.md, python/README.md and docs/*.md (docs/notes/ holds dated notes,
which may name what has since moved). For every command in a ```bash/```sh block:
- a script or file it runs or names (./scripts/x.sh, benchmarks/python/y.py, ./python) exists, and
  a shell script is executable;
- a program under build/ (build/examples/train_lm, build/benchmarks/gwt_bench_interleaved) is a
  CMake executable target of that folder;
- each --flag it passes is parsed somewhere in the repository's scripts, examples, benchmarks or
  package sources (a renamed flag fails), and each -DGWT_* option is a cache variable of the
  CMake project.
For every relative Markdown link: the file exists, and an #anchor is a heading of that file
(GitHub's slugs). Long commands (the main job, the test suite) are not run: what they need is
checked here, and CI runs scripts/test.sh itself.
"""

import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[1])
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# Flags of tools that are not ours.
FOREIGN = {"cmake", "pip", "python3", "python", "torchrun", "source", "git", "ctest", "ninja"}
FLAG_SOURCES = ("scripts", "examples", "benchmarks", "python/gwt", "tests")


def tracked(*paths):
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", *paths], capture_output=True,
                         text=True, check=True).stdout.split()
    return [ROOT / p for p in out]


def pages():
    names = ["README.md", "CONTRIBUTING.md", "python/README.md"]
    names += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return [ROOT / n for n in names if (ROOT / n).exists()]


def commands(text):
    """(line number, command) of each command line in the shell blocks."""
    inside = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            inside = True
        elif line.startswith("```"):
            inside = False
        elif inside and line.strip() and not line.lstrip().startswith("#"):
            yield number, line


def words_of(line):
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    # One command per part of `a && b`, `a; b`, `a | b`.
    parts, current = [], []
    for w in words:
        if w in ("&&", "||", ";", "|"):
            parts.append(current)
            current = []
        else:
            current.append(w)
    return parts + [current]


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def main() -> int:
    executables = {}
    for cmake in tracked("*CMakeLists.txt"):
        for name in re.findall(r"add_executable\((\w+)", cmake.read_text(encoding="utf-8")):
            executables.setdefault(cmake.parent.relative_to(ROOT).as_posix(), set()).add(name)
    cache_vars = set()
    for cmake in tracked("*CMakeLists.txt", "*.cmake"):
        text = cmake.read_text(encoding="utf-8")
        cache_vars |= set(re.findall(r"option\((\w+)", text))
        cache_vars |= set(re.findall(r"set\((\w+)[^)]*CACHE", text))
    flag_text = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                          for p in tracked(*FLAG_SOURCES) if p.suffix in
                          {".sh", ".py", ".cpp", ".h", ""} and p.is_file())
    problems = []
    for page in pages():
        rel = page.relative_to(ROOT)
        text = page.read_text(encoding="utf-8")
        for number, line in commands(text):
            for words in words_of(line):
                if not words:
                    continue
                where = f"{rel}:{number}: `{line.strip()}`"
                tool = pathlib.PurePosixPath(words[0]).name
                for w in words:
                    path = w[2:] if w.startswith("./") else w
                    if path.startswith("build/") or path.startswith("build-gpu/"):
                        folder, _, name = path.rpartition("/")
                        folder = folder.split("/", 1)[1] if "/" in folder else ""
                        if w is words[0] or words[0] == "torchrun":
                            if name not in executables.get(folder, set()) and \
                                    not path.endswith((".md", ".json", ".csv", ".txt")):
                                problems.append(f"{where}: no executable target {name} in "
                                                f"{folder or '.'}/CMakeLists.txt")
                        continue
                    if re.match(r"^(scripts|benchmarks|examples|python|tests|docs)(/|$)", path):
                        target = ROOT / path
                        if not target.exists():
                            problems.append(f"{where}: {path} does not exist")
                        elif target.suffix == ".sh" and not target.stat().st_mode & 0o111:
                            problems.append(f"{where}: {path} is not executable")
                    m = re.match(r"^-D(GWT_\w+)=", w)
                    if m and m.group(1) not in cache_vars:
                        problems.append(f"{where}: no CMake option {m.group(1)}")
                    m = re.match(r"^(--[a-z][\w-]*)", w)
                    if m and tool not in FOREIGN and m.group(1) not in flag_text:
                        problems.append(f"{where}: nothing parses {m.group(1)}")
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target) or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            number = text[:m.start()].count("\n") + 1
            if not dest.exists():
                problems.append(f"{rel}:{number}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{rel}:{number}: link to {target}: no such heading")
    print(*problems, sep="\n") if problems else print(
        f"check_docs: the commands and links of {len(pages())} pages hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
