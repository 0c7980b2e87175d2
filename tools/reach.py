"""What a definition reaches: every project definition its code calls or passes as a value, followed
transitively, read from the source with ast (nothing imported, nothing run). tools/reading.py counts it.

Read `Project.reach` first, then `value`: what an expression is, where the code shows it statically.
  a name: a local (`x = Class(...)`, `a, b = f()`, `out.append(x)`), a parameter (annotated, `self`,
    a default, or what the project's callers pass: train.py's `accumulation_step(run_model, parts)`
    types accumulate.py's `parts`), a module-level definition, an import of a project file;
  an attribute: a module's definition, a method of the class or its project bases, what the class
    sets (`self.x = Class(...)`) or annotates (a dataclass field);
  a call: an instance of the class called, what the function returns; `partial(f, ...)` is f.
A value is a set (an `or`, an `if`, two callers: each one). What torch, the stdlib or a builtin gives
is not the project's and is not followed. A use whose value the code does not show (a loop variable
over torch's container, a function passed in) is listed as unresolved where the project could be
behind it (it defines a method of that name, or a local name is called): listed, never guessed.
"""
import ast
import builtins
from pathlib import Path
from typing import NamedTuple

EXTERN = ("extern",)  # torch's, the stdlib's, a builtin's, a literal's
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPES = (*DEFS, ast.Lambda)
UNSEEN = ("__init__", "__post_init__", "__enter__", "__exit__", "__call__", "forward")  # a built object runs these
ITEMS = ("list", "tuple", "sorted", "reversed", "iter", "zip", "enumerate")  # hold their argument's items


class Ctx(NamedTuple):
    """Where an expression is: its module, the functions around it (outermost first), its class."""
    module: str
    funcs: tuple = ()
    cls: tuple = None  # (module, "Class") whose method (or body) this is
    self_cls: tuple = None  # what `self` is: cls, or a subclass whose instance runs cls's method


def union(sets):
    return frozenset().union(*sets)


def arg_names(func):
    a = func.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]


def walk_scope(func):
    """The nodes of a function's own scope (not inside the functions and classes it defines)."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*SCOPES, ast.ClassDef)):
            todo += ast.iter_child_nodes(node)


def walk(node, ctx, role="value"):
    """[(node, ctx, role)] for node and all in it. role: "called" (a call's function), "base" (an attribute's
    object) or "value". Annotations, except clauses and isinstance's classes name a class, they do not use it."""
    out = [(node, ctx, role)]
    if isinstance(node, SCOPES):
        ctx = ctx._replace(funcs=ctx.funcs + (node,))
    elif isinstance(node, ast.ClassDef) and not ctx.funcs:
        ctx = ctx._replace(cls=(ctx.module, node.name), self_cls=(ctx.module, node.name))
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass"):
        children = [("args", node.args[0])]
    else:
        children = [(f, c) for f, v in ast.iter_fields(node) if f not in ("annotation", "returns", "type")
                    for c in (v if isinstance(v, list) else [v]) if isinstance(c, ast.AST)]
    for field, child in children:
        out += walk(child, ctx, "called" if isinstance(node, ast.Call) and field == "func" else
                    "base" if isinstance(node, ast.Attribute) else "value")
    return out


class Project:
    """The project's .py files under root (tests/, tools/ and docs/ left out), parsed."""

    def __init__(self, root):
        self.trees, self.files, self.defs, self.imports, self.methods = {}, {}, {}, {}, {}
        for path in sorted(Path(root).rglob("*.py")):
            rel = path.relative_to(root)
            if not any(p.startswith(".") or p in ("tests", "tools", "docs", "__pycache__") for p in rel.parts):
                module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
                self.files[module], self.trees[module] = rel.as_posix(), ast.parse(path.read_text())
        for module, tree in self.trees.items():
            self._index(module, tree, self.defs.setdefault(module, {}), self.imports.setdefault(module, {}))
        self.memo, self.busy, self.sites = {}, set(), None

    def _index(self, module, tree, defs, imports):
        """defs: {"name" or "Class.method": node}; imports: {local name: ("module", m) or ("name", m, name)}."""
        for node in tree.body:
            if isinstance(node, (*DEFS, ast.ClassDef)):
                defs[node.name] = node
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            defs.update({t.id: node for t in targets if isinstance(t, ast.Name)})  # a constant
            for item in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(item, DEFS):
                    defs[f"{node.name}.{item.name}"] = item
                    self.methods.setdefault(item.name, []).append(f"{self.files[module]} {node.name}.{item.name}")
        for node in ast.walk(tree):  # an import in a function too: a name is one thing per file here
            for a in node.names if isinstance(node, ast.Import) else []:
                top = a.name if a.asname else a.name.split(".")[0]
                imports[a.asname or top] = ("module", top) if top in self.trees else EXTERN
            for a in node.names if isinstance(node, ast.ImportFrom) else []:
                sub = f"{node.module}.{a.name}"
                imports[a.asname or a.name] = ("module", sub) if sub in self.trees else \
                    ("name", node.module, a.name) if node.module in self.trees else EXTERN

    # ------------------------------------------------------------ definitions, their lines, classes

    def node(self, target):
        return self.defs[target[0]][target[1]]

    def is_class(self, target):
        return isinstance(self.node(target), ast.ClassDef)

    def lines(self, target, whole=False):
        """{(file, line)} of a definition, decorators included; a class's head only (its line, docstring
        and attributes: each method is a definition of its own) unless whole."""
        node, file = self.node(target), self.files[target[0]]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans = [(first, node.end_lineno)]
        if not whole and isinstance(node, ast.ClassDef):
            spans = [(first, node.body[0].lineno - 1)] + [(s.lineno, s.end_lineno) for s in node.body
                                                           if not isinstance(s, DEFS)]
        return {(file, n) for a, b in spans for n in range(a, b + 1)}

    def docstring(self, module):
        doc = next(iter(self.trees[module].body), None)
        is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
        return {(self.files[module], n) for n in range(doc.lineno, doc.end_lineno + 1)} if is_doc else set()

    def mro(self, cls):
        """([cls and its project bases, nearest first], whether a base is not the project's: torch's nn.Module)."""
        if ("mro", cls) not in self.memo:
            out, extern = [cls], False
            for r in self.deref(union(self.value(b, Ctx(cls[0])) for b in self.node(cls).bases)):
                more, ext = self.mro(r[1]) if r[0] == "def" and self.is_class(r[1]) else ([], True)
                out, extern = out + [c for c in more if c not in out], extern or ext
            self.memo["mro", cls] = out, extern
        return self.memo["mro", cls]

    def lookup(self, cls, name, after=False):
        """The method `name` an instance of cls runs (after=True: the one super() finds), or None."""
        return next(((c[0], f"{c[1]}.{name}") for c in self.mro(cls)[0][after:] if f"{c[1]}.{name}" in
                     self.defs[c[0]]), None)

    # ------------------------------------------------------------ what an expression is

    def value(self, e, ctx):
        """What e may be, a set of: ("def", target), ("method", target, self's class), ("inst", class),
        ("module", m), ("tuple", (a set per item)), EXTERN. Empty where the code does not show it."""
        key = (id(e), ctx)
        if key in self.memo or key in self.busy:  # busy: a recursion (callers typing each other): none
            return self.memo.get(key, frozenset())
        self.busy.add(key)
        self.memo[key] = frozenset(self._value(e, ctx))
        self.busy.discard(key)
        return self.memo[key]

    def _value(self, e, ctx):
        if isinstance(e, ast.Name):
            return self.name(e.id, ctx)
        if isinstance(e, ast.Attribute):
            return union(self.attribute(r, e.attr, ctx) for r in self.deref(self.value(e.value, ctx)))
        if isinstance(e, ast.Call):
            called = ast.unparse(e.func)
            if called in ("partial", "functools.partial") and e.args:
                return self.value(e.args[0], ctx)  # partial(f, ...) calls f
            if called == "super":
                return {("super", ctx)}
            if called in ITEMS and e.args:
                items = [union(self.items(r) for r in self.deref(self.value(a, ctx))) for a in e.args]
                if called in ("zip", "enumerate"):  # tuples of one item of each
                    items = [frozenset({("tuple", (frozenset({EXTERN}),) * (called == "enumerate") + tuple(items))})]
                return {("tuple", tuple(items))}
            return union(self.result(r) for r in self.deref(self.value(e.func, ctx)))
        if isinstance(e, (ast.BoolOp, ast.IfExp, ast.NamedExpr)):  # x or y, x if c else y, (x := y)
            parts = e.values if isinstance(e, ast.BoolOp) else [e.value] if isinstance(e, ast.NamedExpr) else \
                [e.body, e.orelse]
            return union(self.value(v, ctx) for v in parts)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            return {("tuple", tuple(self.value(x, ctx) for x in (e.values if isinstance(e, ast.Dict) else e.elts)))}
        if isinstance(e, ast.Subscript):
            index = e.slice.value if isinstance(e.slice, ast.Constant) else None
            return union(self.items(r, index) for r in self.deref(self.value(e.value, ctx)))
        if isinstance(e, (ast.Constant, ast.JoinedStr, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Lambda)):
            return {EXTERN}  # arithmetic is on tensors and numbers; a lambda is read where it is
        return set()

    def items(self, r, index=None):
        """What indexing r with a constant, or iterating it, gives."""
        if r[0] != "tuple":
            return set()  # what a torch container holds may be the project's (a ModuleList of Blocks)
        return r[1][index] if isinstance(index, int) and -len(r[1]) <= index < len(r[1]) else union(r[1])

    def deref(self, refs):
        """refs in a fixed order (a run's set order must not change what a recursion cuts), a module-level
        constant standing for its value (OPTIMIZERS[name] is a class of the dict)."""
        nodes = [(r, self.node(r[1]) if r[0] == "def" else None) for r in refs]
        return sorted(union(self.value(n.value, Ctx(r[1][0])) if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                            n.value else {r} for r, n in nodes), key=repr)

    def name(self, name, ctx):
        for i in range(len(ctx.funcs) - 1, -1, -1):
            inner, bound = ctx._replace(funcs=ctx.funcs[:i + 1]), self.bindings(ctx.funcs[i]).get(name, [])
            if bound or name in arg_names(ctx.funcs[i]):  # a parameter rebound (x = x or X()) is both
                return union(self.bound(e, path, inner) for e, path in bound) | self.param(name, inner)
        if name in self.defs[ctx.module] and "." not in name:
            return {("def", (ctx.module, name))}
        imported = self.imports[ctx.module].get(name)
        if imported and imported[0] == "name":
            return self.name(imported[2], Ctx(imported[1]))  # where it is defined, or imported from
        return {imported} if imported else {EXTERN} if hasattr(builtins, name) else set()

    def bindings(self, func):
        """{name: [(expr, path)]}: what a function binds, path indexing into it ("*": an item, a loop's)."""
        if ("bindings", func) in self.memo:
            return self.memo["bindings", func]
        out, here = {}, ast.Constant(None)  # here: a definition or an exception, read where it is

        def bind(target, expr, path=()):
            if isinstance(target, (ast.Tuple, ast.List)):
                for i, t in enumerate(target.elts):
                    bind(t, expr, path + (i,))
            elif isinstance(target, ast.Name):
                out.setdefault(target.id, []).append((expr, path))
        for node in walk_scope(func):
            for t in node.targets if isinstance(node, ast.Assign) else []:
                bind(t, node.value)
            if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value:
                bind(node.target, node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                bind(node.target, node.iter, ("*",))
            elif isinstance(node, ast.withitem) and node.optional_vars:
                bind(node.optional_vars, node.context_expr, ("with",))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
                bind(node.func.value, ast.List(elts=node.args[:1], ctx=ast.Load()))  # out.append(x): out holds x
            elif isinstance(node, (*DEFS, ast.ClassDef, ast.ExceptHandler)) and getattr(node, "name", None):
                bind(ast.Name(node.name), here)
        self.memo["bindings", func] = out
        return out

    def bound(self, expr, path, ctx):
        refs = self.value(expr, ctx)
        for p in path:  # "with x as y": y is known only where x is torch's or the stdlib's
            refs = refs & {EXTERN} if p == "with" else union(self.items(r, None if p == "*" else p)
                                                              for r in self.deref(refs))
        return refs

    def passes(self, func, ctx):
        """The parameters a caller passes by position, in order (self left out), then the keyword-only ones."""
        a = func.args
        static = "staticmethod" in [ast.unparse(d) for d in getattr(func, "decorator_list", [])]
        method = ctx.cls and len(ctx.funcs) == 1 and not static
        return [x.arg for x in a.posonlyargs + a.args][1 if method else 0:] + [x.arg for x in a.kwonlyargs]

    def param(self, name, ctx):
        func, a = ctx.funcs[-1], ctx.funcs[-1].args
        passed = self.passes(func, ctx)
        if name not in passed:  # self (or *args, **kwargs: unknown)
            first = next((x.arg for x in a.posonlyargs + a.args), None)
            return {("inst", ctx.self_cls)} if ctx.cls and len(ctx.funcs) == 1 and name == first else set()
        out = set()
        defaults = {x.arg: d for x, d in zip((a.posonlyargs + a.args)[::-1], a.defaults[::-1])} | \
            {x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d}
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            if arg.arg == name and arg.annotation:
                out |= {("inst", r[1]) for r in self.value(arg.annotation, Ctx(ctx.module)) if r[0] == "def"}
        out |= self.value(defaults[name], ctx._replace(funcs=ctx.funcs[:-1])) if name in defaults else set()
        if len(ctx.funcs) > 1 or isinstance(func, ast.Lambda):
            return out
        target = (ctx.module, f"{ctx.cls[1]}.{func.name}" if ctx.cls else func.name)
        init = func.name == "__init__"
        sites = self.call_sites(ctx.cls[1] if init else func.name) + self.call_sites("__init__" if init else None)
        return out | self.given(sites, name, passed.index(name), lambda refs: target in (
            {r[1] for r in refs if r[0] in ("def", "method")} |
            {self.lookup(r[1], "__init__") for r in refs if r[0] == "def" and self.is_class(r[1])}))

    def given(self, sites, name, position, calls_it):
        """What the calls at sites [(call, ctx)] whose function calls_it(its value) pass as `name` (at position)."""
        out = set()
        for call, where in sites:
            if calls_it(self.value(call.func, where)):
                args = call.args
                if position < len(args) and not any(isinstance(x, ast.Starred) for x in args[:position + 1]):
                    out |= self.value(args[position], where)
                out |= union(self.value(k.value, where) for k in call.keywords if k.arg == name)
        return out

    def call_sites(self, name):
        """[(call, ctx)] of the project's calls of `name` (a function's, a method's or a class's)."""
        if self.sites is None:
            self.sites = {}
            for module, tree in self.trees.items():
                for node, ctx, _ in walk(tree, Ctx(module)):
                    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                        self.sites.setdefault(getattr(node.func, "id", None) or node.func.attr, []).append((node, ctx))
        return self.sites.get(name, [])

    def attribute(self, r, name, ctx):
        if r[0] == "module":
            here = name in self.defs[r[1]] or name in self.imports[r[1]]
            return {("module", f"{r[1]}.{name}")} if f"{r[1]}.{name}" in self.trees else \
                self.name(name, Ctx(r[1])) if here else set()
        if r[0] == "super":
            found = ctx.cls and self.lookup(ctx.cls, name, after=True)
            return {("method", found, ctx.self_cls)} if found else {EXTERN}
        if r[0] not in ("def", "inst") or not self.is_class(r[1]):
            return {EXTERN} if r[0] in ("extern", "tuple") else set()
        if found := self.lookup(r[1], name):
            prop = "property" in [ast.unparse(d) for d in self.node(found).decorator_list]
            return {("method", found, r[1])} | (self.result(("method", found, r[1])) if prop else set())
        if r[0] == "def" and name == "apply":  # an autograd Function: torch runs forward, then backward
            return {("method", m, r[1]) for m in (self.lookup(r[1], "forward"), self.lookup(r[1], "backward")) if m}
        python = name.startswith("__") and name.endswith("__")  # __dict__, __class__
        return self.attributes(r[1], name) or ({EXTERN} if self.mro(r[1])[1] or python else set())

    def attributes(self, cls, name):
        """What an instance of cls holds as `name`: `self.name = ...` in its methods, a class attribute, a field."""
        out = set()
        for c in self.mro(cls)[0]:
            fields = [s.target.id for s in self.node(c).body if isinstance(s, ast.AnnAssign)]  # a dataclass's
            for item in self.node(c).body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == name:
                    out |= {("inst", r[1]) for r in self.value(item.annotation, Ctx(c[0])) if r[0] == "def"}
                    if not self.lookup(c, "__init__"):  # what its constructions pass
                        built = lambda refs: ("def", c) in refs  # noqa: E731
                        out |= self.given(self.call_sites(c[1]), name, fields.index(name), built)
                elif isinstance(item, ast.Assign) and name in [getattr(t, "id", None) for t in item.targets]:
                    out |= self.value(item.value, Ctx(c[0], (), c, cls))
                for node in walk_scope(item) if isinstance(item, DEFS) else []:
                    for t in node.targets if isinstance(node, ast.Assign) else []:
                        for i, x in enumerate(t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(x, ast.Attribute) and x.attr == name and ast.unparse(x.value) == "self":
                                path = (i,) if isinstance(t, ast.Tuple) else ()
                                out |= self.bound(node.value, path, Ctx(c[0], (item,), c, cls))
        return out

    def result(self, r):
        """What calling r gives."""
        if r[0] == "inst":
            found = self.lookup(r[1], "__call__") or self.lookup(r[1], "forward")
            return self.result(("method", found, r[1])) if found else {EXTERN}
        if r[0] not in ("def", "method"):
            return {EXTERN} if r == EXTERN else set()
        func = self.node(r[1])
        if isinstance(func, ast.ClassDef):
            return {("inst", r[1])}
        cls = (r[1][0], r[1][1].split(".")[0]) if r[0] == "method" else None
        ctx = Ctx(r[1][0], (func,), cls, r[2] if cls else None)
        return union(self.value(n.value, ctx) for n in walk_scope(func) if isinstance(n, ast.Return) and n.value)

    # ------------------------------------------------------------ following it

    def reach(self, seeds, stop=frozenset()):
        """From seeds [(target, self's class or None)], every definition reached: ({target read}, {target of
        stop reached: not read on from}, [each unresolved use, in words])."""
        read, stopped, unresolved, todo = set(), set(), set(), list(seeds)
        while todo:
            target, self_cls = todo.pop()
            if target in stop or (target, self_cls) in read:
                stopped |= {target} & stop
                continue
            read.add((target, self_cls))
            node, module = self.node(target), target[0]
            cls = (module, target[1].split(".")[0]) if "." in target[1] else None
            if isinstance(node, ast.ClassDef):  # its head: bases, decorators, attributes
                found = [x for b in node.bases for x in walk(b, Ctx(module), "base")] + \
                    [x for s in node.decorator_list + [s for s in node.body if not isinstance(s, DEFS)]
                     for x in walk(s, Ctx(module, (), target, target))]
            else:
                found = walk(node, Ctx(module, (), cls, self_cls or cls))
                todo += [(cls, None)] if cls else []  # a method is read in its class
            for expr, ctx, role in found:
                if isinstance(expr, (ast.Name, ast.Attribute)) and isinstance(expr.ctx, ast.Load):
                    refs = self.value(expr, ctx)
                    todo += self.uses(refs, role)
                    if not refs and (why := self.unresolved(expr, ctx, role)):
                        unresolved.add(f"{self.files[module]} {target[1]}: {ast.unparse(expr)} ({why})")
        return {t for t, _ in read}, stopped, sorted(unresolved)

    def uses(self, refs, role):
        """[(target, self's class)] that using refs as `role` reads."""
        out = []
        for r in sorted(refs, key=repr):
            if r[0] in ("def", "method") and not r[1][1].endswith(("Error", "Exception")):  # one raised: named
                out.append((r[1], r[2] if r[0] == "method" else None))
                if r[0] == "def" and self.is_class(r[1]) and role != "base":  # built, or passed to be built
                    out += [(m, r[1]) for m in (self.lookup(r[1], name) for name in UNSEEN) if m]
            elif r[0] == "inst" and role == "called":
                out += [(m, r[1]) for m in [self.lookup(r[1], "__call__") or self.lookup(r[1], "forward")] if m]
        return out

    def unresolved(self, expr, ctx, role):
        """Why a use of unknown value may be the project's, or None."""
        if isinstance(expr, ast.Attribute) and expr.attr in self.methods:
            found = self.methods[expr.attr]
            return "the project's " + ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        if isinstance(expr, ast.Name) and role == "called" and \
                any(expr.id in self.bindings(f) or expr.id in arg_names(f) for f in ctx.funcs):
            return "a function passed in"
        return None
