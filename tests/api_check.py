"""A static check of code that CI never runs (GPU-only tests, benchmark scripts, notebooks' `%%gpu_only` cells)
against the current rlbench API: every project name it imports exists, and every call into rlbench it can resolve
passes keyword arguments that the callee has.

`check_source(source, origin, search_dir)` reads the code with `ast` and imports only the project modules it names
(rlbench, and the scripts' sibling modules in `search_dir`). What it resolves:
- `from rlbench.x import Y` / `import rlbench.x as m`: the module and the name exist;
- `m.attr` on a project module or class: the attribute exists;
- a call of a project class or function (`TrainConfig(...)`, `m.build(...)`): the arguments bind to its signature
  (an unknown keyword, too many positionals, a missing required argument without `*`/`**` splats);
- an instance whose type is known (`cfg = TrainConfig(...)`, a return annotation, a dataclass field's type):
  attributes of dataclasses exist (reading or assigning: an assignment to a removed field is silently accepted at
  runtime), method calls bind, and `dataclasses.replace(cfg, ...)` / `cfg.replace(...)` name real fields;
- a local helper that forwards `**kw` into a resolved callee (`def _backend(env, **kw): TrainConfig(..., **kw)`):
  every keyword its callers pass that the helper does not take itself or pop from `kw` is a parameter of the callee;
  a dict with constant keys splatted into a call (`FSDPOptions(**{k: kw.pop(k) for k in ("compile",)})`) likewise.
Anything it cannot resolve (a fixture, an untyped value, an optional dependency missing here) is not checked.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import sys
import typing
from pathlib import Path

PROJECT = ("rlbench",)
"""Top-level packages whose API is checked (plus the sibling modules of the file under check)."""


class Unresolved(Exception):
    """A value whose type the checker cannot know; nothing about it is checked."""


@dataclasses.dataclass
class Inst:
    """An instance of `cls` (a project class)."""

    cls: type


@dataclasses.dataclass
class Keys:
    """A dict literal whose keys are the constants `keys`."""

    keys: frozenset


@dataclasses.dataclass
class LocalDef:
    """A function defined in the file under check."""

    node: ast.FunctionDef


def _is_project(obj) -> bool:
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in PROJECT or getattr(sys.modules.get(module), "__file__", "") in SIBLINGS


SIBLINGS: set[str] = set()
"""Files of sibling modules imported while checking (their API is checked as the project's)."""


def _import(name: str, search_dir: Path | None):
    """The module `name` if it is a project or sibling module, else raise Unresolved; a missing project module raises
    ModuleNotFoundError."""
    top = name.split(".")[0]
    sibling = search_dir is not None and (search_dir / f"{top}.py").is_file()
    if top not in PROJECT and top != "dataclasses" and not sibling:
        raise Unresolved(name)
    if sibling and str(search_dir) not in sys.path:
        sys.path.insert(0, str(search_dir))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == top:
            raise
        raise Unresolved(f"{name} needs {exc.name}") from None  # an optional dependency missing here
    if sibling:
        SIBLINGS.add(getattr(module, "__file__", "") or "")
    return module


def _signature(obj) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _hints(obj) -> dict:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001  (a forward reference this checker cannot evaluate: the type stays unknown)
        return {}


def _as_type(hint):
    """An `Inst` for a project class hint (`X`, `X | None`, `Optional[X]`), else Unresolved."""
    if isinstance(hint, type) and _is_project(hint):
        return Inst(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return _as_type(args[0])
    raise Unresolved(hint)


def _accepts(sig: inspect.Signature, name: str) -> bool:
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


class _Checker:
    def __init__(self, tree: ast.Module, origin: str, search_dir: Path | None, lines: typing.Callable[[int], str]):
        self.origin, self.search_dir, self.where = origin, search_dir, lines
        self.findings: dict[tuple[int, str], None] = {}
        self.returns: dict[str, object] = {}
        self.tree = tree

    def report(self, node: ast.AST, message: str) -> None:
        self.findings[(node.lineno, f"{self.where(node.lineno)}: {message}")] = None

    # -- environments -------------------------------------------------------------------------------------------
    def imported(self, node: ast.AST, name: str, statement: str):
        """Module `name` imported for `node`; None when it is not resolved here, or missing (then reported)."""
        try:
            return _import(name, self.search_dir)
        except Unresolved:
            return None
        except ModuleNotFoundError as exc:
            self.report(node, f"{statement}: {exc}")
            return None

    def bind_import(self, node: ast.Import | ast.ImportFrom, env: dict) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = self.imported(node, alias.name, f"import {alias.name}")
                if module is None:
                    continue
                env[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module(alias.name.split(".")[0]))
            return
        if node.level or node.module is None:
            return
        module = self.imported(node, node.module, f"from {node.module} import ...")
        if module is None:
            return
        for alias in node.names:
            if alias.name == "*":
                continue
            if hasattr(module, alias.name):
                env[alias.asname or alias.name] = getattr(module, alias.name)
                continue
            try:
                env[alias.asname or alias.name] = _import(f"{node.module}.{alias.name}", self.search_dir)
            except (Unresolved, ModuleNotFoundError):
                self.report(node, f"{node.module} has no {alias.name!r}")

    def scope_env(self, body: list[ast.stmt], args: ast.arguments | None, parent: dict) -> dict:
        """`parent` plus this scope's imports, local defs and the names assigned one known type (flow-insensitive)."""
        env = dict(parent)
        if args is not None:
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    env.pop(a.arg, None)
                    with contextlib.suppress(Unresolved):  # an annotated parameter of a project class
                        cls = self.value(a.annotation, parent, quiet=True) if a.annotation else None
                        if inspect.isclass(cls) and _is_project(cls):
                            env[a.arg] = Inst(cls)
        nodes = [n for stmt in body for n in _walk_scope(stmt)]
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                self.bind_import(n, env)
            elif isinstance(n, ast.FunctionDef):
                env[n.name] = LocalDef(n)
        assigned: dict[str, list[ast.expr]] = {}
        for n in nodes:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                assigned.setdefault(n.targets[0].id, []).append(n.value)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
                assigned.setdefault(n.target.id, []).append(n.value)
            elif isinstance(n, (ast.For, ast.comprehension, ast.With, ast.AugAssign)):
                for t in ast.walk(n.target if not isinstance(n, ast.With) else ast.Tuple(
                        [i.optional_vars for i in n.items if i.optional_vars], ast.Load())):
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(None)
        for name in assigned:
            env.pop(name, None)
        for _ in range(2):  # a second round sees the names the first one typed
            for name, values in assigned.items():
                types = []
                for v in values:
                    try:
                        types.append(self.value(v, env, quiet=True))
                    except Unresolved:
                        types.append(None)
                if types and all(t is not None and t == types[0] for t in types):
                    env[name] = types[0]
        return env

    # -- values ---------------------------------------------------------------------------------------------------
    def value(self, node: ast.expr, env: dict, quiet: bool = False):
        """What `node` evaluates to (a project object, an `Inst`, `Keys`, a `LocalDef`), checking on the way unless
        `quiet`; raise Unresolved when unknown."""
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            raise Unresolved(node.id)
        if isinstance(node, ast.Attribute):
            return self.attribute(node, self.value(node.value, env, quiet), quiet)
        if isinstance(node, ast.Call):
            return self.call(node, env, quiet)
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return Keys(frozenset(k.value for k in node.keys))
        if isinstance(node, ast.DictComp) and len(node.generators) == 1:
            it = node.generators[0]
            if (isinstance(it.iter, (ast.Tuple, ast.List)) and isinstance(node.key, ast.Name)
                    and isinstance(it.target, ast.Name) and node.key.id == it.target.id
                    and all(isinstance(e, ast.Constant) for e in it.iter.elts)):
                return Keys(frozenset(e.value for e in it.iter.elts))
        raise Unresolved(type(node).__name__)

    def attribute(self, node: ast.Attribute, base, quiet: bool):
        name = node.attr
        if inspect.ismodule(base) or inspect.isclass(base):
            if hasattr(base, name):
                return getattr(base, name)
            if inspect.ismodule(base):
                with contextlib.suppress(Unresolved, ModuleNotFoundError):
                    return _import(f"{base.__name__}.{name}", self.search_dir)
            if _is_project(base) and not quiet:
                self.report(node, f"{base.__name__} has no attribute {name!r}")
            raise Unresolved(name)
        if isinstance(base, Inst):
            cls = base.cls
            fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
            if name in fields:
                return _as_type(_hints(cls).get(name))
            member = inspect.getattr_static(cls, name, None)
            if isinstance(member, property):
                return _as_type(_hints(member.fget).get("return"))
            if callable(member):
                return ("method", cls, name)
            if member is None and fields and not hasattr(cls, "__getattr__") and not quiet:
                self.report(node, f"{cls.__name__} has no field or attribute {name!r} (fields: {sorted(fields)})")
            raise Unresolved(name)
        raise Unresolved(name)

    def call(self, node: ast.Call, env: dict, quiet: bool):
        func = self.value(node.func, env, quiet)
        if isinstance(func, LocalDef):
            if not quiet:
                self.check_forwarding(node, func.node, env)
            return self.local_return(func.node, env)
        if func is dataclasses.replace and node.args:
            target = self.value(node.args[0], env, quiet)
            if isinstance(target, Inst) and dataclasses.is_dataclass(target.cls):
                self.check_fields(node, target.cls, node.keywords, env, quiet)
                return target
            raise Unresolved("replace")
        if isinstance(func, tuple) and func[0] == "method":
            _, cls, name = func
            method = getattr(cls, name)
            sig = _signature(method)
            if sig is None:
                raise Unresolved(name)
            params = list(sig.parameters.values())
            if params and not isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod)):
                sig = sig.replace(parameters=params[1:])
            if name == "replace" and dataclasses.is_dataclass(cls) and all(
                    p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
                self.check_fields(node, cls, node.keywords, env, quiet)
                return Inst(cls)
            self.check_bind(node, f"{cls.__name__}.{name}", sig, env, quiet)
            return _as_type(_hints(method).get("return"))
        if not callable(func) or not _is_project(func):
            raise Unresolved("call")
        sig = _signature(func)
        if sig is not None:
            self.check_bind(node, getattr(func, "__qualname__", repr(func)), sig, env, quiet)
        if inspect.isclass(func):
            return Inst(func)
        return _as_type(_hints(func).get("return"))

    # -- the checks -----------------------------------------------------------------------------------------------
    def check_bind(self, node: ast.Call, name: str, sig: inspect.Signature, env: dict, quiet: bool) -> None:
        if quiet:
            return
        splat_args = any(isinstance(a, ast.Starred) for a in node.args)
        splats = [k.value for k in node.keywords if k.arg is None]
        explicit = {k.arg: None for k in node.keywords if k.arg is not None}
        for v in splats:  # a dict of known constant keys counts as explicit keywords
            with contextlib.suppress(Unresolved):
                keys = self.value(v, env, quiet=True)
                if isinstance(keys, Keys):
                    explicit.update(dict.fromkeys(keys.keys))
        for k in explicit:
            if not _accepts(sig, k):
                self.report(node, f"{name}() has no parameter {k!r}")
        if splat_args or splats:
            return
        try:
            sig.bind(*[None] * len(node.args), **explicit)
        except TypeError as exc:
            if all(_accepts(sig, k) for k in explicit):
                self.report(node, f"{name}(): {exc}")

    def check_fields(self, node: ast.Call, cls: type, keywords: list[ast.keyword], env: dict, quiet: bool) -> None:
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        for k in keywords:
            if not quiet and k.arg is not None and k.arg not in fields:
                self.report(node, f"replace() of a {cls.__name__}: no field {k.arg!r}")

    def check_forwarding(self, node: ast.Call, fn: ast.FunctionDef, env: dict) -> None:
        """Keywords a call passes to local `fn` that `fn` forwards through `**kw` must fit each callee."""
        if fn.args.kwarg is None:
            return
        kw = fn.args.kwarg.arg
        own = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        popped = _popped_keys(fn, kw)
        passed = [k.arg for k in node.keywords if k.arg is not None and k.arg not in own and k.arg not in popped]
        fn_env = self.scope_env(fn.body, fn.args, env)
        for inner in ast.walk(fn):
            if not isinstance(inner, ast.Call) or not any(
                    k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kw for k in inner.keywords):
                continue
            try:
                callee = self.value(inner.func, fn_env, quiet=True)
            except Unresolved:
                continue
            if isinstance(callee, tuple) or not callable(callee) or not _is_project(callee):
                continue
            sig = _signature(callee)
            for k in passed:
                if sig is not None and not _accepts(sig, k):
                    self.report(node, f"{fn.name}() forwards {k!r} to {callee.__qualname__}(), which has no such "
                                      f"parameter (line {inner.lineno})")

    def local_return(self, fn: ast.FunctionDef, env: dict):
        if fn.name not in self.returns:
            self.returns[fn.name] = None  # recursion guard
            fn_env = self.scope_env(fn.body, fn.args, env)
            types = []
            for n in ast.walk(fn):
                if isinstance(n, ast.Return) and n.value is not None:
                    try:
                        types.append(self.value(n.value, fn_env, quiet=True))
                    except Unresolved:
                        types.append(None)
            self.returns[fn.name] = types[0] if types and all(t is not None and t == types[0] for t in types) else None
        if self.returns[fn.name] is None:
            raise Unresolved(fn.name)
        return self.returns[fn.name]

    def run(self) -> list[str]:
        self.visit_scope(self.tree.body, None, {})
        return [message for _, message in sorted(self.findings)]

    def visit_scope(self, body: list[ast.stmt], args: ast.arguments | None, parent: dict) -> None:
        env = self.scope_env(body, args, parent)
        for stmt in body:
            for n in _walk_scope(stmt):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for d in n.decorator_list:
                        self.visit_expr(d, env)
                    self.visit_scope(n.body, n.args, env)
                elif isinstance(n, (ast.Call, ast.Attribute)):
                    self.visit_expr(n, env)

    def visit_expr(self, node: ast.expr, env: dict) -> None:
        with contextlib.suppress(Unresolved):
            self.value(node, env)


def _walk_scope(node: ast.AST):
    """`ast.walk` that yields nested function definitions but does not enter them."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(reversed(list(ast.iter_child_nodes(n))))


def _popped_keys(fn: ast.FunctionDef, kw: str) -> set:
    """Constant keys `fn` pops from its `**kw` dict: `kw.pop("x")`, or `kw.pop(k)` under `for k in ("x", "y")`."""
    def pops(node, var=None):
        for n in ast.walk(node):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "pop"
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == kw and n.args):
                a = n.args[0]
                if isinstance(a, ast.Constant):
                    yield a.value
                elif var is not None and isinstance(a, ast.Name) and a.id == var[0]:
                    yield from var[1]

    keys = set(pops(fn))
    for n in ast.walk(fn):
        loops = n.generators if isinstance(n, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)) else (
            [n] if isinstance(n, ast.For) else [])
        for loop in loops:
            if (isinstance(loop.target, ast.Name) and isinstance(loop.iter, (ast.Tuple, ast.List))
                    and all(isinstance(e, ast.Constant) for e in loop.iter.elts)):
                keys |= set(pops(n, (loop.target.id, [e.value for e in loop.iter.elts])))
    return keys


def check_source(source: str, origin: str, search_dir: Path | None = None,
                 where: typing.Callable[[int], str] | None = None) -> list[str]:
    """The findings (one line each, `origin:line: message`) of the static API check of `source`."""
    tree = ast.parse(source, origin)
    return _Checker(tree, origin, search_dir, where or (lambda line: f"{origin}:{line}")).run()


def notebook_source(path: Path) -> tuple[str, typing.Callable[[int], str]]:
    """The code cells of notebook `path` as one module (IPython magics and shell lines blanked, so a `%%gpu_only`
    cell is checked as the Python it runs), and a line -> `path cell N line M` map for the findings."""
    cells = json.loads(path.read_text())["cells"]
    lines, origin = [], []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        for j, line in enumerate("".join(cell["source"]).splitlines()):
            lines.append("" if line.lstrip().startswith(("%", "!")) else line)
            origin.append(f"{path.name} cell {i} line {j + 1}")
        lines.append("")
        origin.append(f"{path.name} cell {i}")
    return "\n".join(lines), lambda n: origin[n - 1]


def check_file(path: Path) -> list[str]:
    """`check_source` of a Python file or of a notebook's code cells."""
    if path.suffix == ".ipynb":
        source, where = notebook_source(path)  # notebooks import the benchmarks' modules (benchmarks/ on sys.path)
        return check_source(source, path.name, path.parent.parent / "benchmarks", where)
    return check_source(path.read_text(), str(path), path.parent)
