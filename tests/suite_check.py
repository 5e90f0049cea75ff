"""The commands of benchmarks/gpu_suite.sh, checked on the CPU without running them: every `rlbench` / benchmark /
experiment command line parses with the current argparse parser (a `train` line also builds and validates its
RunConfig through `--print-config`), and every pytest line names existing files with tests of its `-m` marker and
a `-k` whose every name matches a test.

`suite_commands(text)` lists (part, command line) pairs; `check_command(argv)` returns the problems of one line.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
RUN = re.compile(r'run\s+(\S+)\s+(\S+)\s+"\$\(lim [\d.]+\)"\s+"([^"]*)"')


def suite_commands(text: str) -> list[tuple[str, list[str]]]:
    """(part, argv) of every command that gpu_suite.sh's `run NAME GPUS LIMIT "CMD"` lines run, in order.

    Continuation lines are joined, `$common` (the one shell variable holding a command prefix) expanded, `$OUT`
    is `/tmp/gpu_out`; `CMD` splits on `;` and `&&`; leading `VAR=value` words are dropped.
    """
    text = text.replace("\\\n", " ")
    body = text[text.index('for part in "$@"; do case $part in'):]
    out = []
    for chunk in body.split(";;"):
        part = re.match(r"\s*(?:for part in \"\$@\"; do case \$part in\s*)?(\w+)\)", chunk)
        if part is None:
            continue
        variables = dict(re.findall(r'(\w+)="([^"]*)"', re.sub(RUN, "", chunk)))
        for _, _, cmd in RUN.findall(chunk):
            cmd = re.sub(r"\$(\w+)", lambda m, v=variables: v.get(m.group(1), m.group(0)), cmd)
            cmd = cmd.replace("$OUT", "/tmp/gpu_out")
            for line in re.split(r";|&&", cmd):
                words = shlex.split(line)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words.pop(0)
                if words:
                    out.append((part.group(1), words))
    return out


class Parsed(Exception):
    """Raised by the patched `ArgumentParser.parse_args` once the flags parsed: the command stops there."""


def _parse_only(run, argv: list[str]) -> list[str]:
    """Call `run(argv)` with `ArgumentParser.parse_args` stopping after a successful parse; the parse errors."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            run(argv)
        except Parsed:
            return []
        except SystemExit as exc:
            return [f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:] or exc}"]
    return ["the command did not parse its flags with argparse"]


def _check_module(module, argv: list[str]) -> list[str]:
    """A script's flags: its own `parse_args` (with the checks it makes after argparse) when it has one, else the
    argparse parse inside its `main`."""
    entry = getattr(module, "parse_args", None)
    if not inspect.isfunction(entry):
        entry = module.main
    takes_argv = bool(inspect.signature(entry).parameters)
    if entry is module.main:
        return _parse_only(lambda a: entry(a) if takes_argv else _with_argv(entry, a), argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            entry(argv) if takes_argv else _with_argv(entry, argv)
        except SystemExit as exc:
            return [f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"]
        except (ValueError, TypeError) as exc:
            return [f"{type(exc).__name__}: {exc}"]
    return []


def _with_argv(fn, argv: list[str]):
    with mock.patch.object(sys, "argv", ["prog", *argv]):
        return fn()


def _script(relpath: str):
    from rlbench.experiments import load_benchmark

    if not (ROOT / relpath).is_file():
        raise FileNotFoundError(relpath)
    return load_benchmark(relpath, "gpu_suite_" + Path(relpath).stem)


def check_cli(argv: list[str]) -> list[str]:
    """`python -m rlbench.cli ARGV`: train/demo/bench/quickstart build their RunConfig (`--print-config`), `bench e2e` and
    `experiment NAME` parse their flags."""
    from rlbench import cli
    from rlbench.experiments import EXPERIMENTS

    if argv[:2] == ["bench", "e2e"]:
        return _check_module(_script("benchmarks/e2e.py"), argv[2:])
    if argv[:1] == ["experiment"]:
        if len(argv) < 2 or argv[1] not in EXPERIMENTS:
            return [f"no experiment {argv[1:2]}; known: {sorted(EXPERIMENTS)}"]
        target = EXPERIMENTS[argv[1]]
        module = _script(target) if target.endswith(".py") else importlib.import_module(target)
        return _check_module(module, argv[2:])
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = cli.main([*argv, "--print-config"])
        except SystemExit as exc:
            rc = exc.code
    return [] if rc == 0 else [f"rc {rc}: {err.getvalue().strip()}"]


def names_of_tests(path: Path) -> list[str]:
    """Names of the test functions and classes in `path` (what `-k` matches, parametrize ids aside)."""
    tree = ast.parse(path.read_text())
    return [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
            and n.name.startswith(("test", "Test"))]


def check_pytest(args: list[str]) -> list[str]:
    """`python -m pytest ARGS`: the files exist and hold tests of the `-m` markers; every name in `-k` (negated ones
    too: a `not x` that matches nothing is stale) is part of a test's name."""
    files = [ROOT / a for a in args if a.endswith(".py")]
    problems = [f"{f.relative_to(ROOT)} is missing" for f in files if not f.is_file()]
    files = [f for f in files if f.is_file()]
    opts = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-m", "-k")}
    markers = [m for m in re.findall(r"\w+", opts.get("-m", "")) if m not in ("and", "or", "not")]
    for f in files:
        if markers and not any(f"mark.{m}" in f.read_text() for m in markers):
            problems.append(f"-m {opts['-m']!r}: {f.name} has no test marked {' or '.join(markers)}")
    names = [n for f in files for n in names_of_tests(f)]
    for word in re.findall(r"\w+", opts.get("-k", "")):
        if word not in ("and", "or", "not") and not any(word.lower() in n.lower() for n in names):
            problems.append(f"-k {word}: no test in {[f.name for f in files]} has it in its name")
    return problems


def check_command(argv: list[str]) -> list[str]:
    """The problems of one suite command line (an unknown kind of command is one: teach this checker)."""
    words = list(argv)
    if words[0] == "torchrun":
        words = words[1:]
        while words and words[0].startswith("--"):
            words = words[1 if "=" in words[0] else 2:]
        words = ["python3", *words]
    if words[0] not in ("python3", "python"):
        return [f"unknown command {words[0]!r}"]
    if words[1:3] == ["-m", "pytest"]:
        return check_pytest(words[3:])
    if words[1:3] == ["-m", "rlbench.cli"]:
        return check_cli(words[3:])
    if words[1] == "-m":
        return _check_module(importlib.import_module(words[2]), words[3:])
    if words[1].endswith(".py"):
        try:
            return _check_module(_script(words[1]), words[2:])
        except FileNotFoundError:
            return [f"{words[1]} is missing"]
    return [f"unknown command {' '.join(words[:3])!r}"]
