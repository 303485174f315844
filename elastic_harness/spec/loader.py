"""YAML text -> ``JobSpec``, and back.

Conversion is generic over the dataclasses in ``schema``: unknown keys are rejected with
their dotted path and the closest valid name, values are type-checked (an int where a float
is expected is fine; a bool is never an int), then each dataclass validates its ranges.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from elastic_harness.errors import SpecError, SpecErrors  # noqa: F401 - SpecErrors: re-exported
from elastic_harness.spec.schema import REMOVED, FaultSpec, JobSpec

_LIST_ITEMS = {"chaos": FaultSpec}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading plain scalars as YAML 1.2 (its core schema) does, not as
    YAML 1.1 (PyYAML's dialect), whose guesses surprise:

    - booleans are ``true``/``false`` only: ``no``, ``yes``, ``on``, ``off`` stay strings
      (``name: no`` is the name 'no', not False);
    - floats: ``1e-3`` and ``1.0e3`` are numbers (1.1 wants a dot and a signed exponent);
    - integers: decimal (``_`` between digits allowed), ``0x``, ``0o``, ``0b``; ``010`` is
      ten (1.1: octal eight) and ``1:30`` is a string (1.1: ninety, base 60);
    - dates stay strings (1.1 makes ``2024-01-31`` a date).

    Null, anchors and merge keys are ``safe_load``'s. A key given twice in one mapping is an
    error (``_no_duplicates``), not the last one silently winning."""


_TAG = "tag:yaml.org,2002:"
_CORE = {  # tag -> (pattern, first characters): YAML 1.2's core schema, read above
    "bool": (r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    "int": (r"^[-+]?(?:[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+|0b[01_]+)$", "-+0123456789"),
    "float": (r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?"
              r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+0123456789."),
}
_REPLACED = {_TAG + t for t in (*_CORE, "timestamp")}
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _name, (_pattern, _first) in _CORE.items():
    _Loader.add_implicit_resolver(_TAG + _name, re.compile(_pattern), list(_first))


class _FastLoader(getattr(yaml, "CSafeLoader", _Loader)):  # type: ignore[misc]
    """``_Loader`` on libyaml's parser, where PyYAML was built with it (its wheels are): the
    same nodes and marks, about 10x faster. A restarting worker parses its job first thing,
    every rank of every node at once. Its error texts are libyaml's, so a text
    that does not parse is parsed again with ``_Loader`` for PyYAML's (``_yaml``)."""


_FastLoader.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


def _core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    base = {"0x": 16, "0o": 8, "0b": 2}.get(digits[:2], 10)
    return sign * int(digits if base == 10 else digits[2:], base)


_Loader.add_constructor(_TAG + "int", _core_int)
_FastLoader.add_constructor(_TAG + "int", _core_int)


class _Dumper(yaml.SafeDumper):
    """``safe_dump`` that quotes every string either YAML dialect would read as something
    else: ours (a string '1e3') and YAML 1.1 (a string 'no'), so a dumped job reads back
    the same here and in other tools."""


_Dumper.yaml_implicit_resolvers = {
    first: [*yaml.SafeDumper.yaml_implicit_resolvers.get(first, []), *_Loader.yaml_implicit_resolvers.get(first, [])]
    for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Loader.yaml_implicit_resolvers}
}


def _yaml(text: str) -> Any:
    try:
        return _load(_FastLoader, text)
    except yaml.YAMLError:
        return _load(_Loader, text)  # the same verdict, in PyYAML's words


def _load(kind: type, text: str) -> Any:
    loader = kind(text)  # what yaml.load does, with the duplicate check between its steps
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicates(node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _no_duplicates(node: yaml.Node, path: str, seen: set[int]) -> None:
    """A key given twice in one mapping is a ``SpecError`` naming the key and both lines
    (PyYAML keeps the last one without a word). Keys merged in with ``<<`` may be overridden."""
    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            if key.tag == _TAG + "merge" or not isinstance(key, yaml.ScalarNode):
                _no_duplicates(value, path, seen)
                continue
            where = _join(path, key.value)
            if key.value in lines:
                raise SpecError(where, f"given twice, at lines {lines[key.value]} and {key.start_mark.line + 1}",
                                "keep one of them (YAML would silently use the last)")
            lines[key.value] = key.start_mark.line + 1
            _no_duplicates(value, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _no_duplicates(item, f"{path}[{i}]", seen)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a job YAML file, apply ``key.path=value`` overrides, validate."""
    p = Path(path)
    if p.suffix == ".py":
        raise SpecError("", f"'{path}' is a training script, not a job YAML",
                        "name its job YAML here; `run`, `submit`, `spec` and `k8s render` also take a "
                        "script (its job: the YAML beside it, else the defaults)")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SpecError("", f"job file '{path}' does not exist", "check the path") from None
    except OSError as e:
        raise SpecError("", f"cannot read job file '{path}': {e.strerror}", "name a job YAML file") from None
    return parse_job(job_text(data, str(path)), overrides, source=str(path))


_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def job_text(data: bytes, source: str) -> str:
    """Pure: a job file's bytes as text. UTF-8; UTF-16 or UTF-8 with a byte-order mark (what
    a Windows shell may save), as YAML allows; else a ``SpecError`` naming the first byte that
    is not UTF-8, where it is, and the fix."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError:
                break  # not what its mark says: named below
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError("", f"job file '{source}' is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}, "
                        f"column {column})", "save it as UTF-8 (your editor's encoding setting; "
                        "iconv -f latin1 -t utf-8 converts a Latin-1 file)") from None


def script_job(script: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobSpec, Path | None, str]:
    """The job of a training script named without a job file (``run train.py``, or
    ``eh.init()`` given no job under torchrun or python): one rule for every way it runs.

    The job is the YAML beside the script, of the same name (``train.yaml``, else
    ``train.yml``), when that file's ``script.path`` names this script (as
    ``eh.init(Path(__file__).with_suffix(".yaml"))`` reads it); else the spec's defaults, named
    after the script. Either way ``script.path`` is the script, absolute, and ``overrides``
    apply on top. Returns (spec, the YAML used or None, a note on a same-named YAML that is
    not the script's job, else "")."""
    script = Path(script).absolute()
    for beside in (script.with_suffix(".yaml"), script.with_suffix(".yml")):
        if beside.is_file():
            break
    else:
        beside = None
    named = _names_script(beside, script) if beside is not None else ""
    if beside is not None and named == "":
        spec = load_job(beside, overrides)
        return dataclasses.replace(spec, script=dataclasses.replace(spec.script, path=str(script))), beside, ""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in script.stem) or "job"
    spec = parse_job("", [f"name={name}", *overrides], source=str(script), script=str(script))
    note = f"{beside} beside it is not its job: {named}" if named else ""
    return spec, None, note


def _names_script(job: Path, script: Path) -> str:
    """"" when the job file ``job`` runs ``script`` (its ``script.path``, relative to the
    working directory or to the file, is that script), else what it runs instead."""
    raw = parse_raw(job_text(job.read_bytes(), str(job)), str(job))
    target = raw.get("script", {}).get("path") if isinstance(raw.get("script"), dict) else None
    if not target:
        task = raw.get("task", {}).get("target", "") if isinstance(raw.get("task"), dict) else ""
        return f"it runs task.target '{task}'" if task else "it names no script.path"
    if any(c.is_file() and c.resolve() == script.resolve() for c in (Path(target), job.parent / target)):
        return ""
    return f"its script.path is '{target}'"


def parse_job(text: str, overrides: list[str] | tuple[str, ...] = (), source: str = "",
              script: str = "") -> JobSpec:
    """``text`` (a job's YAML) with ``overrides`` applied, validated; ``script``: a
    ``script.path`` set as is (a path is not YAML-parsed like an override's value)."""
    raw = parse_raw(text, source)
    for item in overrides:
        apply_override(raw, item)
    if script:
        raw.setdefault("script", {})["path"] = script
    _one_length(raw)
    return build(JobSpec, raw, "")


def parse_raw(text: str, source: str = "") -> dict:
    """A job's YAML as a mapping, not yet checked against the spec."""
    try:
        raw = _yaml(text)
    except yaml.YAMLError as e:
        raise SpecError("", f"{source or 'job'} is not valid YAML{_yaml_reason(e)}",
                        "fix the YAML there (close brackets and quotes; indent with spaces)") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError("", f"{source or 'job'} must be a mapping of keys, got {type(raw).__name__}",
                        "a job file holds keys such as 'name: my-job' (see 'elastic-harness spec')")
    return raw


def _one_length(raw: dict) -> None:
    """``train.steps`` and ``train.epochs`` both name the run's length: one of them only (the
    defaults cannot tell, so the keys given decide; a resolved spec says ``epochs: 0``)."""
    train = raw.get("train")
    if isinstance(train, dict) and "steps" in train and train.get("epochs") not in (None, 0):
        raise SpecError("train", "both train.steps and train.epochs are set",
                        "keep one: steps counts optimizer updates, epochs full passes over the data")


def apply_override(raw: dict, item: str) -> None:
    """Set ``a.b.c=value`` in a raw mapping; the value is parsed as YAML (so 3 is an int)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SpecError("", f"--set '{item}' is not KEY.PATH=VALUE", "e.g. --set train.steps=20")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(key, "cannot set a key inside a non-mapping value")
    try:
        node[parts[-1]] = _yaml(value)
    except yaml.YAMLError as e:
        raise SpecError(key, f"--set value '{value}' is not valid YAML{_yaml_reason(e, lines=False)}",
                        "quote it, e.g. --set 'key=\"text\"', or close its brackets") from None


def _yaml_reason(e: yaml.YAMLError, lines: bool = True) -> str:
    """PyYAML's own reason, with where it found it (``lines``: a file, not a one-line value)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark and lines else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{where}: {problem}" + (f" ({context})" if context else "")


def build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and types. Every unknown key
    and bad value is reported, all in one ``SpecErrors``, not only the first; a range or
    cross-field rule (``__post_init__``) is checked once the values it reads are sound."""
    if not isinstance(raw, dict):
        raise SpecError(path, f"must be a mapping, got {type(raw).__name__} ({raw!r})")
    fields, hints = shape_of(cls)
    problems: list[SpecError] = []
    for key, value in raw.items():
        if key not in fields and (problem := _not_a_field(_join(path, str(key)), value, fields)):
            problems.append(problem)
    kwargs = {}
    for name, value in raw.items():
        if name not in fields:
            continue
        try:
            kwargs[name] = _convert(hints[name], value, _join(path, name), name)
        except SpecError as e:
            problems.extend(getattr(e, "errors", [e]))
    if problems:
        raise problems[0] if len(problems) == 1 else SpecErrors(problems)
    return cls(**kwargs)


@functools.cache
def shape_of(cls: type) -> tuple[dict[str, dataclasses.Field], dict[str, Any]]:
    """A dataclass's fields and its resolved field types: the same for every job, and
    ``typing.get_type_hints`` compiles each annotation string anew on every call (a few ms
    of every worker's start; ``prepare``)."""
    return {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)


def prepare(cls: type = JobSpec) -> None:
    """Resolve the field types of ``cls`` and of every dataclass inside it now, so that a
    process forked after this (the zygote's workers) parses its job without doing it."""
    for tp in shape_of(cls)[1].values():
        for inner in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                prepare(inner)
    for item in _LIST_ITEMS.values():
        shape_of(item)


def _not_a_field(dotted: str, value: Any, fields: dict) -> SpecError | None:
    """Why key ``dotted`` is refused: a key removed in an earlier release (None when its value
    asks for what happens now), or an unknown key with the closest valid name."""
    gone = REMOVED.get(dotted)
    if gone is not None:
        if value in gone.still_meant:
            return None
        return SpecError(dotted, f"{value!r} was removed in {gone.version}: {gone.why}", gone.instead)
    close = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], fields, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
    return SpecError(dotted, "unknown key", hint)


def _convert(tp: Any, value: Any, path: str, name: str) -> Any:
    if tp is Any:  # a field that reads its own shapes (``parallelism``: spec.layout)
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, path)
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose one of {list(choices)}"
            raise SpecError(path, f"'{value}' is not one of {list(choices)}", hint)
        return value
    if tp is list:
        return _convert_list(value, path, name)
    if tp is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp in _SCALARS:
        return _SCALARS[tp](value, path)
    raise AssertionError(f"unsupported spec type {tp} at {path}")


def _convert_list(value: Any, path: str, name: str) -> list:
    """A list field; one of specs (``_LIST_ITEMS``) builds each, every problem reported at once."""
    if not isinstance(value, list):
        raise SpecError(path, f"must be a list, got {type(value).__name__}")
    item_cls = _LIST_ITEMS.get(name)
    if item_cls is None:
        return list(value)
    items, problems = [], []
    for i, v in enumerate(value):
        try:
            items.append(build(item_cls, v, f"{path}[{i}]"))
        except SpecError as e:
            problems.extend(getattr(e, "errors", [e]))
    if problems:
        raise problems[0] if len(problems) == 1 else SpecErrors(problems)
    return items


def _to_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        yaml11 = isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n")
        raise SpecError(path, f"must be true or false, got {value!r}",
                        "write true or false (YAML 1.2: yes/no/on/off are text)" if yaml11 else "")
    return value


def _to_int(value: Any, path: str) -> int:
    if isinstance(value, float) and value.is_integer():  # steps: 1e4
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    return value


def _to_float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(path, f"must be a number, got {value!r}")
    return float(value)


def _to_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise SpecError(path, f"must be a string, got {value!r}")
    return value


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_dict(spec: Any) -> dict:
    return dataclasses.asdict(spec)


def dump_job(spec: JobSpec) -> str:
    """The resolved spec as YAML; ``parse_job(dump_job(s)) == s``."""
    return yaml.dump(to_dict(spec), Dumper=_Dumper, sort_keys=False)


def describe(cls: type = JobSpec, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field: the reference printed by ``spec --help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.append((key, "", f.metadata.get("doc", "")))
            rows.extend(describe(tp, key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((key, repr(default), f.metadata.get("doc", "")))
        if f.name in _LIST_ITEMS:
            rows.extend(describe(_LIST_ITEMS[f.name], f"{key}[]"))
    return rows
