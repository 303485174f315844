"""YAML text -> ``JobSpec``, and back.

Conversion is generic over the dataclasses in ``schema``: unknown keys are rejected with
their dotted path and the closest valid name, values are type-checked (an int where a float
is expected is fine; a bool is never an int), then each dataclass validates its ranges.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from elastic_harness.errors import SpecError, SpecErrors  # noqa: F401 - SpecErrors: re-exported
from elastic_harness.spec.schema import REMOVED, FaultSpec, JobSpec

_LIST_ITEMS = {"chaos": FaultSpec}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does: ``1e-3`` and ``1.0e3`` are
    floats (YAML 1.1, PyYAML's dialect, wants a dot and a signed exponent, so ``lr: 1e-3``
    arrived as the string '1e-3'). Everything else is ``safe_load``'s."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read a job YAML file, apply ``key.path=value`` overrides, validate."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError("", f"job file '{path}' does not exist", "check the path") from None
    except OSError as e:
        raise SpecError("", f"cannot read job file '{path}': {e.strerror}", "name a job YAML file") from None
    return parse_job(text, overrides, source=str(path))


def parse_job(text: str, overrides: list[str] | tuple[str, ...] = (), source: str = "") -> JobSpec:
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
    for item in overrides:
        apply_override(raw, item)
    _one_length(raw)
    return build(JobSpec, raw, "")


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
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
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose one of {list(choices)}"
            raise SpecError(path, f"'{value}' is not one of {list(choices)}", hint)
        return value
    if tp is list:
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
    if tp is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():  # steps: 1e4
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported spec type {tp} at {path}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_dict(spec: Any) -> dict:
    return dataclasses.asdict(spec)


def dump_job(spec: JobSpec) -> str:
    """The resolved spec as YAML; ``parse_job(dump_job(s)) == s``."""
    return yaml.safe_dump(to_dict(spec), sort_keys=False)


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
