"""Typed configuration: one dataclass per script, read from defaults < a TOML file < command-line flags.

Every field carries its help text (units, what 0 / None mean) in `field(metadata={"help": ...})`;
the command-line parser is generated from the dataclass, so flags and config keys cannot drift apart.
Unknown keys in the TOML file are errors, as are required fields left unset.

A script's config is composed of sections: dataclasses defined beside the component that uses their options
(the trainer's ObjectiveOptions in training/objective_options.py, ...), each checking its own options (`problems()`),
inherited by the script's config class. Flags and TOML keys stay flat (--noise_offset, noise_offset = 0.05);
--help lists them by section. A field whose type is a list of dataclass records (the trainer's datasets) is
read from a TOML array of tables ([[datasets]]) and has no flag of its own.

On the command line, flags are matched exactly (argparse would take --lr for --lr_num_cycles) and a usage
error is one line naming the flag and the closest real one, or the valid values. --help starts with what the
script does and its common options (a config class's COMMON_OPTIONS), then every option by section.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import time
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

ConfigT = TypeVar("ConfigT")
REQUIRED = dataclasses.MISSING


def option(default: Any = REQUIRED, help: str = "", url_refusal: str = "", **kwargs: Any) -> Any:
    """A config field with its help text. Leave `default` out for a required field. A Path field refuses a URL
    (local_path); `url_refusal` says why and what to do instead, where a general "takes a local path" is not enough."""
    metadata = {"help": help, "url_refusal": url_refusal}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, gs://, https://...
NO_UPLOAD = "writing to object storage is not supported yet; write a local file and copy it to the bucket (aws s3 cp, rclone)"


def local_path(text: str, url_refusal: str = "") -> Path:
    """A Path flag's value. A URL is refused (ValueError): Path("s3://bucket/x") would be the local folder
    s3:/bucket/x, and everything meant for the bucket would be written there."""
    if URL.match(text):
        raise ValueError(f"{text}: {url_refusal}" if url_refusal else f"{text} is a URL: this flag takes a local path")
    return Path(text)


def _path_type(field: dataclasses.Field) -> Any:
    """argparse's type for a Path field: local_path, its refusal the field's own."""

    def parse(text: str) -> Path:
        try:
            return local_path(text, field.metadata.get("url_refusal", ""))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _add_argument(parser: Any, field: dataclasses.Field, annotation: Any) -> None:  # a parser or one of its argument groups
    base, _ = _unwrap_optional(annotation)
    default = field.default if field.default is not REQUIRED else None
    if field.default_factory is not REQUIRED:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
    help_text = field.metadata.get("help", "")
    help_text += " (required)" if field.default is REQUIRED and field.default_factory is REQUIRED else f" (default: {default})"  # type: ignore[misc]
    kwargs: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is Literal:
        kwargs["choices"] = typing.get_args(base)
        kwargs["type"] = type(typing.get_args(base)[0])
    elif typing.get_origin(base) is list:
        kwargs["nargs"] = "+"
        item_type = typing.get_args(base)[0]
        kwargs["type"] = parse_bool if item_type is bool else finite_float if item_type is float else _path_type(field) if item_type is Path else item_type
    else:
        kwargs["type"] = finite_float if base is float else _path_type(field) if base is Path else base
    parser.add_argument(f"--{field.name}", **kwargs)


NOT_FINITE = "is not a finite number"


def finite_float(text: str) -> float:
    """A float flag's value (or a list item's): no option means anything at infinity or NaN (an infinite learning
    rate trained a UNet of non-finite values), so `inf`, `nan` and what overflows to them (1e999) are refused."""
    value = float(text)  # a ValueError is argparse's own "invalid float value" line
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} {NOT_FINITE}")
    return value


def parse_bool(text: str) -> bool:
    """A list item of a list[bool] flag on the command line (--dataset_shuffle_caption true false)."""
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return words[text.lower()]


def record_type(annotation: Any) -> type | None:
    """The record class of a list-of-records field (list[SomeDataclass]), else None."""
    base, _ = _unwrap_optional(annotation)
    if typing.get_origin(base) is list and dataclasses.is_dataclass(typing.get_args(base)[0]):
        return typing.get_args(base)[0]
    return None


def _records(value: Any, record_class: type, name: str, source: str) -> list:
    """A TOML array of tables ([[name]]) as a list of record_class, each table's keys checked and coerced."""
    if not isinstance(value, list) or not all(isinstance(table, dict) for table in value):
        raise ValueError(f"{source}: {name} must be an array of tables ([[{name}]] sections)")
    hints = typing.get_type_hints(record_class)
    fields = {field.name: field for field in dataclasses.fields(record_class)}
    records = []
    for number, table in enumerate(value, start=1):
        where = f"{source}: [[{name}]] number {number}"
        unknown = sorted(set(table) - set(fields))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid: {sorted(fields)}")
        missing = [key for key, field in fields.items() if key not in table and field.default is REQUIRED and field.default_factory is REQUIRED]  # type: ignore[misc]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        records.append(record_class(**{key: _coerce(item, hints[key], key, where, fields[key]) for key, item in table.items()}))
    return records


def _toml_path(text: str, field: dataclasses.Field, name: str, source: str) -> Path:
    try:
        return local_path(text, field.metadata.get("url_refusal", ""))
    except ValueError as error:
        raise ValueError(f"{source}: {name} = {text!r}{str(error).removeprefix(text)}") from None


def _coerce(value: Any, annotation: Any, name: str, source: str, field: dataclasses.Field) -> Any:
    """Convert a TOML value to the field's type, or explain the mismatch."""
    base, optional = _unwrap_optional(annotation)
    if value is None and optional:
        return None
    if record_type(annotation) is not None:
        return _records(value, record_type(annotation), name, source)
    if typing.get_origin(base) is Literal:
        if value not in typing.get_args(base):
            raise ValueError(f"{source}: {name} = {value!r} is not one of {typing.get_args(base)}")
        return value
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            raise ValueError(f"{source}: {name} must be a list")
        item_type = typing.get_args(base)[0]
        accepted = str if item_type is Path else (int, float) if item_type is float else item_type  # TOML writes 3200 for 3200.0
        wrong = [item for item in value if not isinstance(item, accepted) or (isinstance(item, bool) and item_type is not bool)]
        if wrong:
            expected = "str" if item_type is Path else "number" if item_type is float else item_type.__name__
            raise ValueError(f"{source}: {name} items must be of type {expected}, got {wrong!r}")
        not_finite = [item for item in value if item_type is float and not math.isfinite(item)]
        if not_finite:
            raise ValueError(f"{source}: {name} = {value!r}: {not_finite[0]!r} {NOT_FINITE}")
        return [_toml_path(item, field, name, source) if item_type is Path else item_type(item) for item in value]
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # TOML's inf and nan
            raise ValueError(f"{source}: {name} = {value!r} {NOT_FINITE}")
        return float(value)
    if base is Path and isinstance(value, str):
        return _toml_path(value, field, name, source)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"{source}: {name} = {value!r} should be of type {getattr(base, '__name__', base)}")
    return value


UNKNOWN_FLAG_HINT = "(--help lists every flag)"


def closest_name(typed: str, names: list[str]) -> str | None:
    """The real flag (or TOML key) a mistyped one most likely meant: the one whose words' initials it is
    (--lr: --learning_rate), else the most similar spelling; None when nothing is close."""
    bare = typed.lstrip("-")
    initials = [name for name in names if len(bare) > 1 and "".join(word[:1] for word in name.lstrip("-").split("_")) == bare]
    if len(initials) == 1:
        return initials[0]
    close = difflib.get_close_matches(typed, names, n=1)
    return close[0] if close else None


class _Parser(argparse.ArgumentParser):
    """argparse with every flag matched exactly, and every usage error in one line: the unknown flag and the
    closest real one, or argparse's own line (the flag and its valid values) without the usage block."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unknown(extras[0]))
        return parsed

    def _unknown(self, argument: str) -> str:
        if not argument.startswith("-"):
            return f"unexpected argument {argument} {UNKNOWN_FLAG_HINT}"
        typed = argument.split("=", 1)[0]
        closest = closest_name(typed, [flag for flag in self._option_string_actions if flag.startswith("--")])
        return f"unknown flag {typed}; did you mean {closest}? {UNKNOWN_FLAG_HINT}" if closest else f"unknown flag {typed} {UNKNOWN_FLAG_HINT}"

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# How long a quiet rank (every rank of a job but the first) waits on a bad configuration before it ends the
# job: torchrun stops every rank at the first failure, so a quiet rank exiting at once could stop the first
# rank, which reads the same flags, before it printed why (a test saw nothing at all on screen). A rank whose
# flags alone fail (a --config file missing on its machine) says why itself after the wait.
QUIET_RANK_GRACE_S = 30.0


class _QuietParser(_Parser):
    """Prints no help or usage; on an error it leaves the first rank QUIET_RANK_GRACE_S to say it and end
    the job, then says it itself and exits as ArgumentParser would."""

    def _print_message(self, message: str, file: Any = None) -> None:
        pass

    def exit(self, status: int = 0, message: str | None = None) -> typing.NoReturn:
        if status and message:
            time.sleep(QUIET_RANK_GRACE_S)
            sys.stderr.write(message)
        sys.exit(status)


def _help_text(description: str, config_class: type) -> str:
    """What --help prints before the full reference: the script's description, then its common options
    (config_class.COMMON_OPTIONS: name -> a short line), one line each with the default."""
    common = getattr(config_class, "COMMON_OPTIONS", {})
    if not common:
        return description
    fields = {field.name: field for field in dataclasses.fields(config_class)}  # type: ignore[arg-type]
    lines = [("--config", "a TOML file with any of the options; flags override it")]
    for name, text in common.items():
        field = fields[name]
        if field.default is REQUIRED and field.default_factory is REQUIRED:  # type: ignore[misc]
            text += " (required)"
        elif field.default not in (None, False, REQUIRED):
            text += f" (default: {field.default})"
        lines.append((f"--{name}", text))
    width = max(len(flag) for flag, _ in lines) + 2
    listed = "\n".join(f"  {flag:<{width}}{text}" for flag, text in lines)
    return f"{description.rstrip()}\n\nCommon options (every option follows, by section; also in docs/flags.md):\n{listed}"


class _RecordingNamespace(argparse.Namespace):
    """argparse's result, recording every value each flag was given, in order, into `given` (flag name -> values):
    argparse keeps only the last."""

    RECORD = "_given"

    def __init__(self, given: dict[str, list[Any]]) -> None:
        super().__init__()
        object.__setattr__(self, self.RECORD, given)

    def __setattr__(self, name: str, value: Any) -> None:
        getattr(self, self.RECORD).setdefault(name, []).append(value)
        super().__setattr__(name, value)


def _repeated_flag_warnings(parser: argparse.ArgumentParser, given: dict[str, list[Any]]) -> list[str]:
    """A warning for each flag given twice or more with different values. The last value counts, as argparse users
    expect: a launch script's own flags followed by "$@" are overridden that way (STYLE.md: thin launch scripts).
    Refusing would break every such wrapper; saying nothing would hide an edit made to the wrong copy of a flag."""
    actions = {action.dest: action for action in parser._actions}
    warnings = []
    for name, values in given.items():
        shown = [_shown(actions[name], value) for value in values if value is not argparse.SUPPRESS]
        if len(set(shown)) > 1:
            flag = actions[name].option_strings[0]
            warnings.append(f"warning: {flag} is given {'twice' if len(shown) == 2 else f'{len(shown)} times'} ({', then '.join(shown)}): using the last, {shown[-1]}")
    return warnings


def _shown(action: argparse.Action, value: Any) -> str:
    """A flag's value as it was typed: a list's items, or for a boolean flag the spelling used (--x / --no-x)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return action.option_strings[0] if value else action.option_strings[1]
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse_config(config_class: type[ConfigT], argv: list[str] | None = None, description: str = "", quiet: bool = False) -> ConfigT:
    """Build `config_class` from defaults, then `--config FILE.toml`, then command-line flags. With `quiet`
    (every process of a job but one), a bad configuration is left to that one to print (see _QuietParser)."""
    hints = typing.get_type_hints(config_class)
    fields = dataclasses.fields(config_class)  # type: ignore[arg-type]
    parser_class = _QuietParser if quiet else _Parser
    parser = parser_class(
        usage="%(prog)s [-h] [--config FILE.toml] [--option VALUE ...]",
        description=_help_text(description, config_class), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="FILE.toml", help="TOML file with any of the options below; flags override it")
    for section, section_fields in sections(config_class):
        group = parser.add_argument_group(section) if section else parser
        for field in section_fields:
            if record_type(hints[field.name]) is None:
                _add_argument(group, field, hints[field.name])
    given: dict[str, list[Any]] = {}
    cli = vars(parser.parse_args(argv, _RecordingNamespace(given)))
    cli.pop(_RecordingNamespace.RECORD)
    for warning in _repeated_flag_warnings(parser, given):
        parser._print_message(warning + "\n", sys.stderr)

    values: dict[str, Any] = {}
    config_path = cli.pop("config", None)
    if config_path is not None:
        try:
            with open(config_path, "rb") as handle:
                from_file = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as error:
            parser.error(f"cannot read --config {config_path}: {error}")
        known = {field.name for field in fields}
        unknown = sorted(set(from_file) - known)
        if unknown:
            meant = {key: closest_name(key, sorted(known)) for key in unknown}
            guesses = [f"{name}" if len(unknown) == 1 else f"{name} for {key}" for key, name in meant.items() if name]
            hint = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
            parser.error(f"{config_path}: unknown keys {unknown}{hint}; see --help for the valid names")
        try:
            by_name = {field.name: field for field in fields}
            values.update({key: _coerce(value, hints[key], key, str(config_path), by_name[key]) for key, value in from_file.items()})
        except ValueError as error:
            parser.error(str(error))
    values.update(cli)
    missing = [f"--{field.name}" for field in fields if field.name not in values and field.default is REQUIRED and field.default_factory is REQUIRED]  # type: ignore[misc]
    if missing:
        parser.error(f"missing required options: {', '.join(missing)}")
    config = config_class(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        problems = validate()
        if problems:
            # Not a usage error: the flags parsed, their values are wrong, and each problem names its flag.
            parser.exit(2, f"{parser.prog}: error: invalid configuration:\n  " + "\n  ".join(problems) + "\n")
    return config


def sections(config_class: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """The config's fields by the section (dataclass) that declares them, in the order of its bases: each
    section's title is its docstring's first line ("" for fields the config class declares itself)."""
    all_fields = {field.name: field for field in dataclasses.fields(config_class)}  # type: ignore[arg-type]
    grouped: dict[type, list[dataclasses.Field]] = {}
    for name, field in all_fields.items():
        owner = next(cls for cls in config_class.__mro__ if name in vars(cls).get("__annotations__", {}))
        grouped.setdefault(owner, []).append(field)
    ordered = [cls for cls in config_class.__mro__ if cls in grouped]
    return [("" if cls is config_class else (cls.__doc__ or cls.__name__).strip().splitlines()[0], grouped[cls]) for cls in ordered]


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    return {key: _plain(value) for key, value in dataclasses.asdict(config).items()}


def write_resolved_config(config: Any, path: Path) -> None:
    """Save the fully resolved config (JSON) so a run can be understood and repeated later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_to_dict(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
