"""Reading settings: a named config of a YAML file with the command line's overrides on top, each
value typed and checked as ``settings.config`` declares it, the tutorial's spellings accepted;
and ``dump``, the resolved config as YAML that reads back the same."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import itertools
import logging
import math
import operator
import os
import re
import typing
from typing import Any, Literal, Optional

import yaml

from settings.config import (CONFIG_CLASSES, Config, default_value, field_types,
                             identity_fields, to_dict, validate)
from settings.errors import ConfigError

log = logging.getLogger(__name__)

RENAMED = {
    "lr_schedule": "lr, end_lr, warmup_steps and lr_scaling",
    "start_lr": "lr",
    "warmup": "warmup_steps",
    "N_out_channels": "n_out_channels",
    "ngf": "base_width",
}
# Command-line flags kept from the tutorials, as (key, value) they set.
FLAG_ALIASES = {
    "enable_amp": ("amp_mode", "fp16"),
    "enable_apex": ("enable_fused", True),
    "enable_benchy": ("throughput_report", True),
}
# Settings and values kept from the tutorials under their names there.
SETTING_ALIASES = {"row_parallel_size": "tensor_parallel"}
VALUE_ALIASES = {("data_loader_config", "dali"): "dali-lowmem",
                 ("data_loader_config", "pytorch"): "lowmem"}
ENTRY_ARGS = ("yaml_config", "config")
# Names that mean a setting or a value where their spelling is nearer another one (batch_size
# is not patch_size, gpu is not cpu): ``nearest`` suggests these first, where they are choices.
MEANINGS = {
    "batch_size": ("global_batch_size", "local_batch_size"), "batch": ("global_batch_size",),
    "bs": ("global_batch_size", "local_batch_size"), "learning_rate": ("lr",),
    "steps": ("num_iters",), "max_steps": ("num_iters",), "precision": ("amp_mode",),
    "compile": ("enable_jit",), "grad_clip": ("max_grad_norm",), "tp": ("tensor_parallel",),
    "cp": ("context_parallel",), "out_dir": ("expdir",), "output_dir": ("expdir",),
    "log_dir": ("expdir",), "logdir": ("expdir",), "gpu": ("cuda",), "fp32": ("none",),
}


# ----------------------------------------------------------------------------- YAML loading


_ENV = re.compile(r"\$\{(\w+)(:-([^}]*))?\}|\$(\w+)")


def expand_env(value: str) -> str:
    """Expand $VAR, ${VAR} and ${VAR:-default}; an unset variable without default is an error."""

    def sub(m):
        name = m.group(1) or m.group(4)
        if name in os.environ and (os.environ[name] or m.group(2) is None):
            return os.environ[name]
        if m.group(2) is not None:
            return m.group(3)
        raise ConfigError(f"environment variable ${name} is not set (used in '{value}'): "
                          f"export it, or override the value on the command line")

    return _ENV.sub(sub, value)


def load_yaml_configs(path: str) -> dict:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--yaml_config {path}: no such file; the configs live in config/ViT.yaml "
                          f"and config/UNet.yaml") from None
    except IsADirectoryError:
        raise ConfigError(f"--yaml_config {path} is a directory: name a YAML file in it, e.g. "
                          f"config/ViT.yaml") from None
    except (OSError, UnicodeDecodeError) as e:  # unreadable: permissions, a binary file, ...
        raise ConfigError(f"--yaml_config {path} cannot be read ({e}): name a readable YAML "
                          f"file, e.g. config/ViT.yaml") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--yaml_config {path} is not valid YAML: {yaml_problem(e)}") from None
    example = "e.g. 'quickstart:' and below it, indented, 'lr: 1e-3'"
    if doc is None:
        raise ConfigError(f"--yaml_config {path} is empty: it must map config names to their "
                          f"settings, {example}")
    if not isinstance(doc, dict):
        raise ConfigError(f"--yaml_config {path} holds a {_yaml_kind(doc)}, not a mapping of "
                          f"config names to their settings: {example}")
    for name, settings in doc.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"--yaml_config {path}: config '{name}' holds a "
                              f"{_yaml_kind(settings)}, not a mapping of settings: {example}")
    return doc


def _yaml_kind(value) -> str:
    kinds = {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
             type(None): "null value"}
    return kinds.get(type(value), type(value).__name__)


def yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's reason on one line, with the line and column where it found it (and where
    the construct it was reading began): e.g. ``line 3, column 1: found character '\\t' that
    cannot start any token (indent with spaces, not tabs)``."""
    if isinstance(e, yaml.MarkedYAMLError):
        text = e.problem or e.context or "unreadable"
        if "'\\t'" in text:
            text += " (indent with spaces, not tabs)"
        if isinstance(e, yaml.constructor.ConstructorError) and "tag" in text:
            text += (" (tags such as !!python/object are not read: write plain values, lists "
                     "and mappings)")
        if e.context and e.problem and e.context_mark is not None:
            text += (f" ({e.context} that starts at line {e.context_mark.line + 1}, column "
                     f"{e.context_mark.column + 1})")
        if e.problem_mark is not None:
            text = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: {text}"
    elif isinstance(e, yaml.reader.ReaderError):
        text = (f"character {e.position + 1}: unacceptable character #x{e.character:04x} "
                f"({e.reason}): save it as UTF-8 text")
    else:
        text = str(e)
    return " ".join(text.split())


def value_text(v) -> str:
    """A value as it is written in YAML or on the command line (``true``, ``null``, ``[1,2]``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return repr(v) if v == "" or " " in v else v
    return str(v).replace(" ", "")


def nearest(name: str, choices, listed: bool = False) -> str:
    """'did you mean ...?' with what ``name`` means (``MEANINGS``), else the closest of
    ``choices`` (letter case aside), else the valid ones (or, where the message ``listed`` them
    already, a word to pick one)."""
    by_lower = {c.lower(): c for c in choices}
    close = [m for m in MEANINGS.get(name.lower(), ()) if m in choices] or [
        by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=1,
                                                      cutoff=0.5)]
    if close:
        return f"did you mean {' or '.join(repr(c) for c in close)}?"
    return "choose one of these" if listed else f"valid: {', '.join(sorted(choices))}"


# ----------------------------------------------------------------------------- coercion


_BOOL_WORDS = {"true": True, "yes": True, "1": True, "on": True,
               "false": False, "no": False, "0": False, "off": False}
# What each scalar type is called in its error, and the fix said after it.
_KINDS = {bool: ("a boolean", "use true or false"),
          int: ("an integer", "give a whole number, e.g. {key}=4"),
          float: ("a number", "give e.g. {key}=1e-3"), str: ("a string", "")}


def _coerce_scalar(key, value, tp):
    """``value`` as a ``tp`` (bool, int, float or str), or a ConfigError saying what it is not."""
    what, fix = _KINDS[tp]
    if tp is bool:
        word = value.lower() if isinstance(value, str) else None
        if isinstance(value, bool) or word in _BOOL_WORDS:
            return _BOOL_WORDS.get(word, value)
    elif isinstance(value, bool):  # (to Python a bool is an int; here it never is one)
        fix = ""
    elif tp is str and isinstance(value, (str, int, float)):
        return expand_env(str(value))
    elif isinstance(value, (str, int)) or isinstance(value, float) and (tp is float or value.is_integer()):
        with contextlib.suppress(ValueError):
            try:
                number = tp(value)  # (a string too: YAML 1.1 reads 5E-4 as one)
            except OverflowError:  # an integer beyond any float
                number = math.inf
            if tp is int or math.isfinite(number):
                return number
            what = "a finite number"  # nan and inf parse as floats but are never a setting
    raise ConfigError(f"{key}={value!r} is not {what}" + (f": {fix.format(key=key)}" if fix else ""))


# A setting's bounds (``_f``'s checks): name -> (the comparison its value must pass, its sign).
_BOUNDS = {"min": (operator.ge, ">="), "max": (operator.le, "<="), "above": (operator.gt, ">"),
           "below": (operator.lt, "<")}


def _coerce_choice(key, value, choices):
    """``value`` read as the type of ``choices``; where they mix types (``resume``: false, true
    or "auto"), as the first type that reads it as a choice ("yes" as true), else as given."""
    types = dict.fromkeys(type(c) for c in choices)
    if len(types) == 1:
        return _coerce_scalar(key, value, *types)
    for tp in types:
        with contextlib.suppress(ConfigError):
            if (v := _coerce_scalar(key, value, tp)) in choices:
                return v
    return value


def _coerce_item(key, value, tp, meta):
    """One value of type ``tp`` (a scalar type or ``Literal[...]``), checked against ``meta``."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if (v := _coerce_choice(key, value, choices)) not in choices:
            aliases = [alias for (k, alias) in VALUE_ALIASES if k == key]
            raise ConfigError(f"{key}={v!r} is not one of {', '.join(map(value_text, choices))}: "
                              f"{nearest(str(v), [value_text(c) for c in choices] + aliases, listed=True)}")
        return v
    v = _coerce_scalar(key, value, tp)
    for bound, (ok, sign) in _BOUNDS.items():
        if bound in meta and not ok(v, meta[bound]):
            raise ConfigError(f"{key}={v} must be {sign} {meta[bound]}")
    return v


def coerce(cls, key: str, value: Any):
    """``value`` (from YAML or the command line) as the type of ``cls``'s field ``key``, checked."""
    tp = field_types(cls)[key]
    meta = {f.name: f for f in dataclasses.fields(cls)}[key].metadata
    if typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp):  # Optional
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.safe_load(value if value.strip().startswith("[") else f"[{value}]")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is not a list: give e.g. {key}=[1,2]")
        (item,) = typing.get_args(tp)
        out = [_coerce_item(f"{key}[{i}]", v, item, meta) for i, v in enumerate(value)]
        if "length" in meta and len(out) != meta["length"]:
            raise ConfigError(f"{key}={out} must have {meta['length']} entries, e.g. "
                              f"{key}={default_value(cls, key)}")
        return out
    return _coerce_item(key, value, tp, meta)


def parse_overrides(argv: list[str]) -> tuple[dict, dict]:
    """(entry arguments, overrides) of ``--key value``, ``--key=value``, ``--key value value ...``
    (a list, as ``--key '[value,value]'``) and bare ``--flag`` arguments, in command-line order:
    strings, lists of strings or True (a bare flag), typed later against the config class."""
    entry, overrides = {}, {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}': settings are given as --key value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            values = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i + 1:]))
            val = True if not values else values[0] if len(values) == 1 else values
            i += len(values)
        key = key.replace("-", "_") if key.replace("-", "_") in ENTRY_ARGS else key
        if key in ENTRY_ARGS and isinstance(val, list):
            raise ConfigError(f"unexpected argument '{val[1]}': --{key} takes one value")
        if key in ENTRY_ARGS and val is True:
            example = "config/ViT.yaml" if key == "yaml_config" else "quickstart"
            raise ConfigError(f"--{key} needs a value: e.g. --{key} {example}")
        (entry if key in ENTRY_ARGS else overrides)[key] = val
        i += 1
    return entry, overrides


def _apply(cls, values: dict, source: str) -> dict:
    fields = {f.name for f in dataclasses.fields(cls)}
    out, aliased = {}, {}  # aliased: setting -> the flag alias that set it
    for key, val in values.items():
        if key in SETTING_ALIASES:
            target = SETTING_ALIASES[key]
            if target in values and coerce(cls, target, values[target]) != coerce(cls, target, val):
                raise ConfigError(f"--{key} is --{target}, and both are given ({key}={val}, "
                                  f"{target}={values[target]}; {source}): keep one of them")
            key = target
        if isinstance(val, str):
            val = VALUE_ALIASES.get((key, val), val)
        if key in FLAG_ALIASES:
            target, alias_val = FLAG_ALIASES[key]
            if _coerce_scalar(key, val, bool):
                out[target] = coerce(cls, target, alias_val)
                aliased[target] = key
            continue
        if key in identity_fields(cls):
            raise ConfigError(f"'{key}' is not a setting ({source}): the config's name and file are "
                              f"chosen with --config and --yaml_config; remove '{key}'")
        if key not in fields:
            family = {c: m for m, c in CONFIG_CLASSES.items()}
            others = [m for c, m in family.items() if c is not cls and key in c.__dataclass_fields__]
            if RENAMED.get(key):
                hint = f"use {RENAMED[key]}"
            elif others:  # e.g. the U-Net's memory_format given to a ViT config
                hint = (f"a setting of {' and '.join(others)} configs, not of "
                        f"{family.get(cls, cls.__name__)} ones: remove it")
            else:
                hint = nearest(key, fields - set(identity_fields(cls)))
            raise ConfigError(f"unknown setting '{key}' ({source}): {hint}")
        out[key] = _coerce_given(cls, key, val, source)
    for target, alias in aliased.items():  # both given: which should win is not for us to guess
        given, meant = values.get(target), FLAG_ALIASES[alias][1]
        if given is not None and coerce(cls, target, given) != coerce(cls, target, meant):
            raise ConfigError(f"--{alias} means {target}={meant} but {target}={given} is also "
                              f"given ({source}): keep one of them")
    return out


def _coerce_given(cls, key, val, source):
    """``coerce``, saying so when a command-line setting was given without its value (a bare
    ``--lr`` reads as true), or with several values for a setting that takes one."""
    tp = field_types(cls)[key]
    takes_list = any(typing.get_origin(t) is list for t in (tp, *typing.get_args(tp)))
    if isinstance(val, list) and source == "command line" and not takes_list:
        dashed = [v for v in val[1:] if re.fullmatch(r"-[A-Za-z_][\w-]*(=.*)?", v)]
        fix = (f"'{dashed[0]}' has one dash: write --{dashed[0][1:]}" if dashed else
               "quote a value that holds spaces")
        raise ConfigError(f"--{key} takes one value, not {len(val)} ({' '.join(val)}): {fix}")
    try:
        return coerce(cls, key, val)
    except ConfigError:
        if val is True and source == "command line":
            raise ConfigError(f"--{key} needs a value: e.g. --{key} {default_value(cls, key)}") from None
        raise


def _yaml_files_holding(name: str, yaml_path: str) -> list[str]:
    """The other YAML files beside ``yaml_path`` (the project's config/ folder) that define a
    config ``name``; relative to the working directory when inside it."""
    folder = os.path.dirname(yaml_path)
    found = []
    for other in sorted(glob.glob(os.path.join(folder, "*.yaml"))):
        with contextlib.suppress(ConfigError):  # a broken neighbour is not this error's subject
            if not os.path.samefile(other, yaml_path) and name in load_yaml_configs(other):
                rel = os.path.relpath(other)
                found.append(other if rel.startswith("..") else rel)
    return found


def build_config(yaml_path: str, name: str, overrides: Optional[dict] = None) -> Config:
    """The named config of the YAML file with overrides applied, typed and validated."""
    configs = load_yaml_configs(yaml_path)
    if name not in configs:
        close = difflib.get_close_matches(name, list(configs), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        elsewhere = _yaml_files_holding(name, yaml_path)
        if elsewhere:
            hint = (f"it is in {' and '.join(elsewhere)}: add --yaml_config {elsewhere[0]}; or ")
        raise ConfigError(f"--config {name}: no such config in {yaml_path}: {hint}choose one of "
                          f"{', '.join(configs)}")
    raw = dict(configs[name])
    model = str(raw.get("model", "vit")).lower()
    if isinstance(overrides, dict) and "model" in overrides:
        if overrides["model"] is True:  # a bare --model
            raise ConfigError("--model needs a value: e.g. --model unet")
        model = str(overrides["model"]).lower()
    if model not in CONFIG_CLASSES:
        raise ConfigError(f"model={model!r} in config '{name}' is not one of "
                          f"{', '.join(CONFIG_CLASSES)}")
    cls = CONFIG_CLASSES[model]
    values = _apply(cls, raw, f"config '{name}' in {yaml_path}")
    cli = _apply(cls, overrides or {}, "command line")
    # Alternatives (num_epochs or num_iters, global_batch_size or local_batch_size): the one the
    # command line gives wins over the config's.
    for given, dropped in (("num_epochs", "num_iters"), ("num_iters", "num_epochs"),
                           ("global_batch_size", "local_batch_size")):
        if given in cli and dropped not in cli:
            values.pop(dropped, None)
    if "global_batch_size" in cli and cli.get("local_batch_size") is not None:
        raise ConfigError(f"both --global_batch_size {cli['global_batch_size']} and "
                          f"--local_batch_size {cli['local_batch_size']} are given: keep one "
                          f"(local_batch_size sets the global batch to local x data-parallel "
                          f"ranks); for larger steps than fit in memory use --grad_accum_steps")
    values.update(cli)
    cfg = cls(name=name, yaml_path=yaml_path, **values)
    validate(cfg)
    cfg.command_line = frozenset(cli)  # (not a setting: which settings the command line gave)
    return cfg


def dump(cfg: Config, derived: Optional[dict] = None) -> str:
    """The resolved config as YAML that ``--yaml_config`` reads back under the same name, as a new
    run with the same settings (``run_num``, ``resume`` and ``resume_from`` at their defaults).
    The file it was read from, the run's name and the ``derived`` values (the per-rank batch,
    the peak lr, ...) are comment lines above the settings."""
    settings = to_dict(cfg, identity=False)
    for key in ("run_num", "resume", "resume_from"):
        settings[key] = default_value(type(cfg), key)
    text = yaml.safe_dump({cfg.name: settings}, sort_keys=False, default_flow_style=None)
    notes = {"read from": cfg.yaml_path} if cfg.yaml_path else {}
    if cfg.run_num != settings["run_num"]:
        notes["run"] = cfg.run_num
    notes.update(derived or {})
    return "".join(f"# {k}: {v}\n" for k, v in notes.items()) + text
