"""Static extraction of a script's argparse definition, without running the script.

Registration must never execute tool code: a script dropped into the repository may be half-written, slow to
import, or hostile. So we read the source with :mod:`ast` and accept only what can be known from the text:
``ArgumentParser(...)`` calls bound to names, ``add_argument`` calls on those parsers (and on their argument
groups and mutually exclusive groups) whose option strings are literals, and keyword values that are literals,
module-level literal constants, or the well-known argparse names.

Anything that makes the text an unreliable picture of the runtime parser — ``add_argument`` in a loop, on a
parser passed in from elsewhere, with ``*args``/``**kwargs``, sub-commands, parent parsers, two parsers that
both take arguments, one name bound to several parsers, ``add_argument`` under a condition the parser does not
share, a non-default ``prefix_chars``, a computed ``set_defaults`` — yields :class:`Extraction` with a
``dynamic_reason``. The caller then reports the script
or, only if explicitly allowed, falls back to :mod:`cacherouter.tools.reflection`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import SchemaError
from .schema import Action, ArgumentSpec, JsonType, ScriptSchema

_TYPE_NAMES: dict[str, JsonType] = {"int": "integer", "float": "number", "str": "string"}
_PATH_TYPES = frozenset({"Path", "pathlib.Path", "PurePath", "os.fspath"})
_ACTIONS: dict[str, Action] = {
    "store": "store",
    "store_true": "store_true",
    "store_false": "store_false",
    "store_const": "store_const",
    "append": "append",
    "extend": "extend",
    "count": "count",
}
_IGNORED_ACTIONS = frozenset({"help", "version"})
_NARGS_NAMES = {"OPTIONAL": "?", "ZERO_OR_MORE": "*", "ONE_OR_MORE": "+", "REMAINDER": "..."}
_MAX_RANGE_CHOICES = 256
# Statements and expressions whose body may not run: an argument added there may not exist at run time.
_CONDITIONALS = (ast.If, ast.Try, ast.TryStar, ast.ExceptHandler, ast.Match, ast.match_case, ast.IfExp, ast.BoolOp)


class _Dynamic(Exception):
    """Internal: the parser cannot be known from the source text."""


@dataclass(frozen=True, kw_only=True)
class Extraction:
    """The outcome of static analysis: a schema, or the reason the parser is dynamic."""

    schema: ScriptSchema | None
    dynamic_reason: str | None = None


class _Unknown:
    """A value that exists at run time but not in the source text (e.g. ``default=os.getcwd()``)."""


_UNKNOWN = _Unknown()
_SUPPRESS = object()


def extract_static(source: str, *, filename: str = "<script>") -> Extraction:
    """Extract the argparse schema of ``source`` by reading it; never imports or runs it.

    Raises :class:`SchemaError` when the source does not parse as Python, or is too deeply nested to analyse.
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        where = f"line {e.lineno}: " if e.lineno else ""  # e.g. null bytes carry no line
        raise SchemaError(f"{filename}: not valid Python ({where}{e.msg}); fix the script") from e
    except ValueError as e:  # null bytes (before Python 3.11.4), lone surrogates
        raise SchemaError(f"{filename}: not valid Python ({e}); fix the script") from e
    except (RecursionError, MemoryError) as e:  # the parser's own limits: a hostile or generated script
        raise SchemaError(f"{filename}: too deeply nested for the Python parser; simplify the script") from e
    try:
        return Extraction(schema=_Analyser(tree).run())
    except _Dynamic as e:
        return Extraction(schema=None, dynamic_reason=str(e))
    except (RecursionError, MemoryError) as e:  # ast.unparse and friends recurse on deep expressions
        raise SchemaError(f"{filename}: an expression is too deeply nested to analyse; simplify the script") from e


class _Analyser:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.docstring = (ast.get_docstring(tree) or "").strip()
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.argparse_modules: set[str] = set()  # names bound to the argparse module
        self.argparse_names: dict[str, str] = {}  # local name -> argparse attribute (from-imports)
        self.constants = self._module_constants()
        self.warnings: list[str] = []

    # -- set-up ---------------------------------------------------------------------------------------------

    def _module_constants(self) -> dict[str, Any]:
        """Module-level names bound exactly once to a literal, usable as ``choices=NAMES``."""
        seen: dict[str, int] = {}
        values: dict[str, Any] = {}
        for node in self.tree.body:
            targets: list[ast.expr] = []
            value: ast.expr | None = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            for target in targets:
                if isinstance(target, ast.Name) and value is not None:
                    seen[target.id] = seen.get(target.id, 0) + 1
                    try:
                        values[target.id] = ast.literal_eval(value)
                    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                        values.pop(target.id, None)
        return {name: value for name, value in values.items() if seen[name] == 1}

    def _collect_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "argparse":
                        self.argparse_modules.add(alias.asname or "argparse")
            elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
                for alias in node.names:
                    if alias.name == "*":
                        raise _Dynamic("'from argparse import *' hides which names are argparse's")
                    self.argparse_names[alias.asname or alias.name] = alias.name

    def _argparse_attr(self, node: ast.expr) -> str | None:
        """``argparse.X`` or a from-imported ``X`` -> ``"X"``; anything else -> None."""
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in self.argparse_modules
        ):
            return node.attr
        if isinstance(node, ast.Name):
            return self.argparse_names.get(node.id)
        return None

    # -- main walk -----------------------------------------------------------------------------------------

    def run(self) -> ScriptSchema:
        self._collect_imports()
        if not self.argparse_modules and not self.argparse_names:
            # No argparse at all: a tool without parameters.
            return ScriptSchema(description=_first_paragraph(self.docstring), source="none")

        parser_calls: dict[str, ast.Call] = {}  # parser variable -> ArgumentParser(...) call
        owners: dict[str, str] = {}  # group variable -> parser variable
        exclusive: dict[str, bool] = {}  # exclusive-group variable -> required
        all_parser_calls: list[ast.Call] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self._argparse_attr(node.func) == "ArgumentParser":
                all_parser_calls.append(node)
                self._check_parser_options(node)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("add_subparsers", "add_parser")
            ):
                raise _Dynamic("sub-commands (add_subparsers) are not supported as one tool")
        for node in ast.walk(self.tree):
            target, value = _single_binding(node)
            if target is None or not isinstance(value, ast.Call):
                continue
            if self._argparse_attr(value.func) == "ArgumentParser":
                if target in parser_calls or target in owners:
                    # Rebinding, or a local of the same name in two functions: only run time knows which is used.
                    raise _Dynamic(f"line {value.lineno}: the name '{target}' is bound to several parsers")
                parser_calls[target] = value
            elif isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name):
                receiver = value.func.value.id
                owner = receiver if receiver in parser_calls else owners.get(receiver)
                if owner is None or value.func.attr not in ("add_argument_group", "add_mutually_exclusive_group"):
                    continue
                is_exclusive = value.func.attr == "add_mutually_exclusive_group"
                # Reusing a name for another plain group of the same parser is common and harmless; anything
                # else would merge what argparse keeps apart.
                harmless = owners.get(target) == owner and target not in exclusive and not is_exclusive
                if (target in parser_calls or target in owners) and not harmless:
                    raise _Dynamic(f"line {value.lineno}: the name '{target}' is bound to several groups or parsers")
                owners[target] = owner
                if is_exclusive:
                    exclusive[target] = bool(self._kwarg_value(value, "required", default=False))

        calls = self._method_calls("add_argument", "set_defaults")
        add_calls = [call for call, method in calls if method == "add_argument"]
        if not parser_calls and not add_calls and not all_parser_calls:
            return ScriptSchema(description=_first_paragraph(self.docstring), source="none")
        if not parser_calls and all_parser_calls and add_calls:
            raise _Dynamic("the ArgumentParser is not bound to a name the arguments are added to")

        used_parsers: set[str] = set()
        specs: list[ArgumentSpec] = []
        groups: dict[str, list[str]] = {}
        parser_defaults: dict[str, Any] = {}  # set_defaults so far; argparse applies them to later arguments too
        for call, method in calls:
            holder = call.func.value if isinstance(call.func, ast.Attribute) else None
            ours = isinstance(holder, ast.Name) and (holder.id in parser_calls or holder.id in owners)
            if not isinstance(holder, ast.Name) or not ours:
                if method == "set_defaults":
                    continue  # not a parser built here, so not the one whose schema we read
                where = ast.unparse(holder) if holder is not None else "?"
                raise _Dynamic(f"line {call.lineno}: add_argument on '{where}', which is not a parser built here")
            parser = owners.get(holder.id, holder.id)
            self._reject_dynamic_context(call, method, parser_calls[parser])
            used_parsers.add(parser)
            if method == "set_defaults":
                values = self._set_defaults(call)
                parser_defaults.update(values)
                specs = [_with_default(s, values[s.dest], call) if s.dest in values else s for s in specs]
                continue
            spec = self._argument(call)
            if spec is None:
                continue
            if spec.dest in parser_defaults and not any(kw.arg == "default" for kw in call.keywords):
                spec = _with_default(spec, parser_defaults[spec.dest], call)
            specs.append(spec)
            if holder.id in exclusive:
                groups.setdefault(holder.id, []).append(spec.dest)
        if len(used_parsers) > 1:
            raise _Dynamic(f"arguments are added to {len(used_parsers)} different parsers: {sorted(used_parsers)}")
        dests = [spec.dest for spec in specs]
        duplicates = sorted({dest for dest in dests if dests.count(dest) > 1})
        if duplicates:
            raise _Dynamic(f"several arguments share a destination: {duplicates}")

        parser_name = next(iter(used_parsers), next(iter(parser_calls), None))
        description = ""
        if parser_name is not None:
            description = self._parser_description(parser_calls[parser_name])
        return ScriptSchema(
            description=description or _first_paragraph(self.docstring),
            # Help is formatted last: %(default)s shows the default after every set_defaults.
            arguments=tuple(replace(spec, help=_format_help(spec)) for spec in specs),
            exclusive_groups=tuple((tuple(dests), exclusive[name]) for name, dests in groups.items()),
            source="static",
            warnings=tuple(self.warnings),
        )

    def _check_parser_options(self, call: ast.Call) -> None:
        for kw in call.keywords:
            if kw.arg is None:
                raise _Dynamic(f"line {call.lineno}: ArgumentParser options given as **kwargs")
            if kw.arg == "parents":
                raise _Dynamic("the parser inherits arguments from parent parsers (parents=...)")
            if kw.arg == "fromfile_prefix_chars" and self._resolve(kw.value) is not None:
                # A value such as "@/etc/passwd" would make argparse read that file as more arguments.
                raise _Dynamic(f"line {call.lineno}: fromfile_prefix_chars lets an argument value name a file")
            if kw.arg == "argument_default" and self._resolve(kw.value) is not None:
                raise _Dynamic(f"line {call.lineno}: argument_default changes every argument's default")
            if kw.arg == "prefix_chars" and self._resolve(kw.value) != "-":
                # The argument vector is built with '-' options; another prefix would turn them into positionals.
                raise _Dynamic(f"line {call.lineno}: prefix_chars={ast.unparse(kw.value)} is not supported")

    def _method_calls(self, *methods: str) -> list[tuple[ast.Call, str]]:
        """``x.method(...)`` calls for the given method names, in source order."""
        found = [
            (node, node.func.attr)
            for node in ast.walk(self.tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods
        ]
        return sorted(found, key=lambda pair: (pair[0].lineno, pair[0].col_offset))

    def _ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        parent = self.parents.get(node)
        while parent is not None:
            yield parent
            parent = self.parents.get(parent)

    def _reject_dynamic_context(self, call: ast.Call, method: str, parser: ast.Call) -> None:
        """Reject a call on the parser that may run several times, or (unlike the parser itself) not at all."""
        around_parser = set(self._ancestors(parser))
        child: ast.AST = call
        for node in self._ancestors(call):
            if isinstance(node, ast.For | ast.AsyncFor | ast.While | ast.comprehension):
                raise _Dynamic(f"line {call.lineno}: {method} inside a loop builds the parser at run time")
            if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp | ast.Lambda):
                raise _Dynamic(f"line {call.lineno}: {method} inside an expression builds the parser at run time")
            if isinstance(node, _CONDITIONALS) and node not in around_parser and not _in_main_guard(node, child):
                raise _Dynamic(f"line {call.lineno}: {method} under a condition may not run; the schema could be wrong")
            child = node

    def _set_defaults(self, call: ast.Call) -> dict[str, Any]:
        """``set_defaults(dest=value, ...)`` as dest -> literal value (``_UNKNOWN`` when computed)."""
        if call.args or any(kw.arg is None for kw in call.keywords):
            raise _Dynamic(f"line {call.lineno}: set_defaults with **kwargs or positional arguments")
        return {kw.arg: self._resolve(kw.value) for kw in call.keywords if kw.arg is not None}

    def _parser_description(self, call: ast.Call) -> str:
        for kw in call.keywords:
            if kw.arg == "description":
                if isinstance(kw.value, ast.Name) and kw.value.id == "__doc__":
                    return _first_paragraph(self.docstring)
                value = self._resolve(kw.value)
                return value.strip() if isinstance(value, str) else ""
        return ""

    # -- one add_argument call -------------------------------------------------------------------------------

    def _argument(self, call: ast.Call) -> ArgumentSpec | None:
        names: list[str] = []
        for arg in call.args:
            if isinstance(arg, ast.Starred):
                raise _Dynamic(f"line {call.lineno}: option strings given as *args")
            value = self._resolve(arg)
            if not isinstance(value, str):
                raise _Dynamic(f"line {call.lineno}: option string is not a literal ({ast.unparse(arg)})")
            names.append(value)
        if any(kw.arg is None for kw in call.keywords):
            raise _Dynamic(f"line {call.lineno}: keyword arguments given as **kwargs")
        if not names:
            raise _Dynamic(f"line {call.lineno}: add_argument without a name")
        kwargs = {kw.arg: kw.value for kw in call.keywords if kw.arg is not None}
        optional = names[0].startswith("-")

        action = self._action(call, kwargs.get("action"))
        if action is None:
            return None
        help_text = self._help(call, kwargs.get("help"))
        if help_text is None:
            return None  # hidden from --help (argparse.SUPPRESS), so hidden from the model too

        json_type, path_like = self._type(call, kwargs.get("type"))
        nargs = self._nargs(call, kwargs.get("nargs"))
        choices = self._choices(call, kwargs.get("choices"))
        if choices and "type" not in kwargs and not all(isinstance(c, str) for c in choices):
            # argparse compares the raw string with the choices, so non-string choices can never match.
            self.warnings.append(f"line {call.lineno}: {names[0]} has non-string choices but no type=")

        has_default = "default" in kwargs
        default: Any = None
        if has_default:
            default = self._resolve(kwargs["default"])
            if default is _SUPPRESS:
                has_default, default = False, None
            elif default is _UNKNOWN:
                self.warnings.append(f"line {call.lineno}: default of {names[0]} is computed at run time")
                default = None
        if action == "store_true" and not has_default:
            has_default, default = True, False
        elif action == "store_false" and not has_default:
            has_default, default = True, True

        if "dest" in kwargs:
            dest_value = self._resolve(kwargs["dest"])
            if not isinstance(dest_value, str):
                raise _Dynamic(f"line {call.lineno}: dest is not a literal")
            dest = dest_value
        elif optional:
            longs = [n for n in names if n.startswith("--")]
            dest = (longs[0] if longs else names[0]).lstrip("-").replace("-", "_")
        else:
            dest = names[0]

        if optional:
            required_value = self._resolve(kwargs["required"]) if "required" in kwargs else False
            if not isinstance(required_value, bool):
                raise _Dynamic(f"line {call.lineno}: required= is not a literal")
            required = required_value
        else:
            required = nargs not in ("?", "*") and not (nargs == "..." and has_default)
        return ArgumentSpec(
            dest=dest,
            option_strings=tuple(names) if optional else (),
            action=action,
            json_type=json_type,
            nargs=nargs,
            choices=choices,
            default=default,
            has_default=has_default,
            required=required,
            help=help_text,  # raw: formatted once the defaults are final (see _format_help)
            path_like=path_like,
        )

    def _action(self, call: ast.Call, node: ast.expr | None) -> Action | None:
        if node is None:
            return "store"
        attr = self._argparse_attr(node)
        if attr == "BooleanOptionalAction":
            return "boolean_optional"
        value = self._resolve(node)
        if isinstance(value, str):
            if value in _IGNORED_ACTIONS:
                return None
            if value in _ACTIONS:
                return _ACTIONS[value]
        raise _Dynamic(f"line {call.lineno}: custom action {ast.unparse(node)}")

    def _help(self, call: ast.Call, node: ast.expr | None) -> str | None:
        """The help text; None when the argument is hidden with argparse.SUPPRESS."""
        if node is None:
            return ""
        value = self._resolve(node)
        if value is _SUPPRESS:
            return None
        if isinstance(value, str):
            return value
        # An f-string or a computed help text only loses documentation, not correctness.
        self.warnings.append(f"line {call.lineno}: help text is computed at run time; left out")
        return ""

    def _type(self, call: ast.Call, node: ast.expr | None) -> tuple[JsonType, bool]:
        if node is None:
            return "string", False
        text = ast.unparse(node)
        if isinstance(node, ast.Name) and node.id in _TYPE_NAMES:
            return _TYPE_NAMES[node.id], False
        if isinstance(node, ast.Name) and node.id == "bool":
            self.warnings.append(
                f"line {call.lineno}: type=bool turns any non-empty text into True; exposed as a string"
            )
            return "string", False
        if text in _PATH_TYPES or text.endswith(".Path"):
            return "string", True
        if isinstance(node, ast.Call) and self._argparse_attr(node.func) == "FileType":
            return "string", True
        self.warnings.append(f"line {call.lineno}: custom type {text} is passed as a string")
        return "string", False

    def _nargs(self, call: ast.Call, node: ast.expr | None) -> int | str | None:
        if node is None:
            return None
        attr = self._argparse_attr(node)
        if attr in _NARGS_NAMES:
            return _NARGS_NAMES[attr]
        value = self._resolve(node)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if value in ("?", "*", "+", "..."):  # "..." is argparse.REMAINDER's value
            return str(value)
        raise _Dynamic(f"line {call.lineno}: nargs is not a literal ({ast.unparse(node)})")

    def _choices(self, call: ast.Call, node: ast.expr | None) -> tuple[Any, ...] | None:
        if node is None:
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            bounds = [self._resolve(arg) for arg in node.args]
            if all(isinstance(b, int) for b in bounds) and 1 <= len(bounds) <= 3:
                values = range(*bounds)
                if len(values) <= _MAX_RANGE_CHOICES:
                    return tuple(values)
        value = self._resolve(node)
        if isinstance(value, list | tuple | set | frozenset):
            items = sorted(value, key=repr) if isinstance(value, set | frozenset) else list(value)
            if all(isinstance(item, str | int | float) for item in items):
                return tuple(items)
        if isinstance(value, dict):
            return tuple(value)
        self.warnings.append(f"line {call.lineno}: choices are computed at run time; not enforced in the schema")
        return None

    # -- values ----------------------------------------------------------------------------------------------

    def _resolve(self, node: ast.expr) -> Any:
        """The literal value of ``node``, or ``_UNKNOWN`` when only run time knows it."""
        attr = self._argparse_attr(node)
        if attr == "SUPPRESS":
            return _SUPPRESS
        if attr in _NARGS_NAMES:
            return _NARGS_NAMES[attr]
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.constants[node.id]
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        return _UNKNOWN

    def _kwarg_value(self, call: ast.Call, name: str, *, default: Any) -> Any:
        for kw in call.keywords:
            if kw.arg == name:
                return self._resolve(kw.value)
        return default


def _single_binding(node: ast.AST) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return node.target.id, node.value
    return None, None


def _in_main_guard(node: ast.AST, child: ast.AST) -> bool:
    """Whether ``child`` is in the body of ``if __name__ == "__main__":``, which always runs: tools run as main."""
    return (
        isinstance(node, ast.If)
        and any(child is statement for statement in node.body)
        and ast.unparse(node.test) in ("__name__ == '__main__'", "'__main__' == __name__")
    )


def _with_default(spec: ArgumentSpec, value: Any, call: ast.Call) -> ArgumentSpec:
    """``spec`` with the default a ``set_defaults`` call gives it."""
    if value is _UNKNOWN:
        raise _Dynamic(f"line {call.lineno}: set_defaults gives '{spec.dest}' a value computed at run time")
    if value is _SUPPRESS:
        return replace(spec, default=None, has_default=False)
    return replace(spec, default=value, has_default=True)


def _format_help(spec: ArgumentSpec) -> str:
    default = str(spec.default) if spec.has_default else "none"
    return spec.help.replace("%(default)s", default).replace("%%", "%").strip()


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n", 1)[0].split()) if text else ""
