"""Command-line flags generated from the config models (pdserve/api/config.py), and configs built back from them.

Invariant: a setting's flag, type, choices, default and help come from its
one declaration in the config model; `pdserve serve|prefill|decode` parse
them with the model's defaults, and `pdserve up` accepts the same flags and
forwards exactly the ones given, verbatim, to both workers. Torch-free.
"""

from __future__ import annotations

import argparse
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from pydantic import BaseModel, ValidationError

from pdserve.api.config import (
    DEFAULT_PORTS, DEVICE_PATTERN, CacheConfig, LimitsConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    ServerConfig, TransferConfig, WorkerConfig)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}

# (section of WorkerConfig, its model, the help group's title); transfer settings exist on P and D only.
SECTIONS: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("model", ModelConfig, "model"),
    ("cache", CacheConfig, "KV pool"),
    ("scheduler", SchedulerConfig, "scheduler"),
    ("server", ServerConfig, "server"),
    ("transfer", TransferConfig, "P/D KV transfer"),
    ("limits", LimitsConfig, "request bounds"),
    ("parallel", ParallelConfig, "tensor parallelism"),
)
FORWARDED_ARGS = "forwarded_worker_args"  # where `up` collects the worker flags it was given


def parse_bytes(text: str) -> int:
    """'512MiB', '2g', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_size_or_auto(text: str) -> Optional[int]:
    """A size (see parse_bytes), or 'auto' -> None."""
    return None if text.strip().lower() == "auto" else parse_bytes(text)


def parse_device(text: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    if re.fullmatch(DEVICE_PATTERN, text) is None:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (use auto, cpu, cuda or cuda:N)")
    return text


# The special parsers a setting can name with `parse=` (pdserve/api/config.py).
PARSERS: dict[str, Callable[[str], Any]] = {
    "bytes": parse_bytes, "size_or_auto": parse_size_or_auto, "device": parse_device}


@dataclass(frozen=True, slots=True)
class FlagSpec:
    section: str
    name: str  # field name in the section's model
    flag: str
    default: Any
    help: str
    converter: Optional[Callable[[str], Any]]  # None: a boolean on/off flag
    choices: Optional[tuple[str, ...]]
    env: Optional[str]
    alias: Optional[str] = None  # a second, short flag

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _value_type(annotation: Any) -> tuple[Optional[Callable[[str], Any]], Optional[tuple[str, ...]]]:
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        return str, tuple(typing.get_args(annotation))
    if annotation is bool:
        return None, None
    if annotation in (int, float, str):
        return annotation, None
    raise TypeError(f"no command-line form for a setting of type {annotation!r}")


def flag_specs(role: str) -> list[FlagSpec]:
    specs = []
    for section, model, _ in SECTIONS:
        if section == "transfer" and role == "colocated":
            continue
        specs += section_flag_specs(section, model, role)
    return specs


def section_flag_specs(section: str, model: type[BaseModel], role: str = "colocated") -> list[FlagSpec]:
    """The flags of one config model (also used by the proxy for the shared `LimitsConfig`)."""
    specs = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra or {}
        converter, choices = _value_type(field.annotation)
        if extra.get("parse") is not None:
            converter = PARSERS[extra["parse"]]
        default = DEFAULT_PORTS[role] if (section, name) == ("server", "port") else field.default
        specs.append(FlagSpec(section, name, extra.get("flag") or "--" + name.replace("_", "-"), default,
                              field.description or "", converter, choices, extra.get("env"), extra.get("alias")))
    return specs


class _Forward(argparse.Action):
    """`up`: check the value like the worker would, keep the flag as typed for the workers."""

    def __init__(self, *args: Any, spec: FlagSpec, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.spec = spec

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        forwarded = list(getattr(namespace, FORWARDED_ARGS, None) or [])
        if self.spec.converter is None:
            forwarded.append(option_string)
        else:
            try:
                self.spec.converter(values)
            except (argparse.ArgumentTypeError, ValueError) as error:
                parser.error(f"argument {option_string}: {error}")
            forwarded += [option_string, values]
        setattr(namespace, FORWARDED_ARGS, forwarded)


def add_worker_flags(parser: argparse.ArgumentParser, role: str, *, forward: bool = False,
                     exclude: Iterable[str] = ()) -> None:
    """Add the flags of a `role` worker. With `forward`, they are collected verbatim for child workers."""
    add_flags(parser, [spec for spec in flag_specs(role) if spec.flag not in set(exclude)], forward=forward)


def add_flags(parser: argparse.ArgumentParser, specs: Iterable[FlagSpec], *, forward: bool = False) -> None:
    groups: dict[str, Any] = {}
    titles = {section: title for section, _, title in SECTIONS}
    for spec in specs:
        group = groups.get(spec.section) or groups.setdefault(spec.section, parser.add_argument_group(titles[spec.section]))
        shown = f"{spec.default >> 20}MiB" if spec.converter is parse_bytes and spec.default is not None else spec.default
        help_text = f"{spec.help} (default: {shown})" if spec.default not in (None, "") else spec.help
        if spec.env:
            help_text += f"; default from ${spec.env}"
        if forward:
            boolean = {"nargs": 0} if spec.converter is None else {"choices": spec.choices}
            names = [spec.flag, "--no-" + spec.flag[2:]] if spec.converter is None else [spec.flag, *_alias(spec)]
            group.add_argument(*names, action=_Forward, spec=spec, dest=spec.dest, default=argparse.SUPPRESS,
                               help=help_text, **boolean)
        elif spec.converter is None:
            group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, dest=spec.dest,
                               default=spec.default, help=spec.help)
        else:
            group.add_argument(spec.flag, *_alias(spec), dest=spec.dest, type=spec.converter, choices=spec.choices,
                               default=spec.default, help=help_text)


def _alias(spec: FlagSpec) -> list[str]:
    return [spec.alias] if spec.alias else []


def section_values(args: argparse.Namespace, specs: Iterable[FlagSpec]) -> dict[str, Any]:
    """{field: value} of one section's parsed flags (environment fallbacks applied)."""
    values = {}
    for spec in specs:
        value = getattr(args, spec.dest, spec.default)
        if value is None and spec.env:
            value = os.environ.get(spec.env) or None
        values[spec.name] = value
    return values


class ConfigError(ValueError):
    """The flags given do not make a valid configuration (the message says why)."""


def worker_config(args: argparse.Namespace, role: str) -> WorkerConfig:
    """The WorkerConfig the parsed flags describe (environment fallbacks applied)."""
    sections: dict[str, dict[str, Any]] = {}
    for spec in flag_specs(role):
        sections.setdefault(spec.section, {}).update(section_values(args, [spec]))
    try:
        return WorkerConfig(role=role, **sections)
    except ValidationError as error:
        flags = {(spec.section, spec.name): spec.flag for spec in flag_specs(role)}
        raise ConfigError("; ".join(_describe(problem, flags) for problem in error.errors())) from None


def _describe(problem: Any, flags: dict[tuple[str, str], str]) -> str:
    location = tuple(str(part) for part in problem.get("loc", ()))
    where = flags.get(location[:2], ".".join(location))
    message = str(problem.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
