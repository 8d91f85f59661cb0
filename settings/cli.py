"""The entry scripts' command line: ``from_argv`` reads the settings (errors as one line, exit
2), and ``--help`` lists the settings of the config that would run, with its values."""
from __future__ import annotations

import dataclasses
import os
import textwrap
import typing

from settings.config import CONFIG_CLASSES, Config, default_value, field_types, identity_fields
from settings.parse import (FLAG_ALIASES, SETTING_ALIASES, VALUE_ALIASES, build_config,
                            load_yaml_configs, parse_overrides, value_text)
from settings.errors import ConfigError, refuse

WIDTH = 100
DEFAULT_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config",
                            "ViT.yaml")  # the entry scripts' --yaml_config when none is given


def _group_of(cls, name: str) -> str:
    """A setting's ``--help`` group: the one it was first declared under (``_group``), else the
    name of the class that declared it ("ViT settings")."""
    klass = next(k for k in reversed(cls.__mro__) if name in getattr(k, "__dataclass_fields__", {}))
    own = klass.__name__.replace("Config", " settings") if klass is not Config else ""
    return klass.__dataclass_fields__[name].metadata.get("group") or own


def _type_text(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ",".join(map(value_text, typing.get_args(tp))) + "}"
    if typing.get_origin(tp) is typing.Union:  # Optional[x]: (x, NoneType)
        return f"{_type_text(typing.get_args(tp)[0])} or null"
    if typing.get_origin(tp) is list:
        return f"list[{_type_text(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def settings_help(cfg: Config) -> str:
    """Every setting of ``cfg``'s class: group headers, then per setting a line
    ``--name TYPE = value`` (``*`` after a value that differs from the built-in default) and its
    description, indented, on the next lines."""
    cls = type(cfg)
    types, lines, group = field_types(cls), [], None
    for f in (f for f in dataclasses.fields(cls) if f.name not in identity_fields(cls)):
        if (group_here := _group_of(cls, f.name)) != group:
            group = group_here
            lines += ["", f"{group[0].upper()}{group[1:]}:"]
        value = getattr(cfg, f.name)
        mark = " *" if value != default_value(cls, f.name) else ""
        lines.append(f"  --{f.name} {_type_text(types[f.name])} = {value_text(value)}{mark}")
        lines += textwrap.wrap(f.metadata["help"], WIDTH, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def usage(prog: str, yaml_path: str, cfg: Config) -> str:
    """The whole ``--help`` text for ``cfg`` read from ``yaml_path``."""
    names = list(load_yaml_configs(yaml_path))
    other = {m: c for m, c in CONFIG_CLASSES.items() if c is not type(cfg)}
    head = [
        f"usage: python {prog} [--yaml_config FILE] [--config NAME] [--key value ...]",
        "",
        *textwrap.wrap(
            f"Shows what would run: config '{cfg.name}' of {yaml_path} ({cfg.model}), with the "
            f"values below (* = differs from the built-in default). Any setting is overridden "
            f"with --key value or --key=value; a bare --flag sets a boolean to true; a list "
            f"setting is written either way: --img_size 352 720 or --img_size '[352,720]' "
            f"(or 352,720). "
            f"'python {prog} --config NAME --help' shows another config.", WIDTH),
        "",
        *textwrap.wrap(f"Configs in {yaml_path}: {', '.join(names)}", WIDTH,
                       subsequent_indent="  "),
        *textwrap.wrap("Other config files: config/ViT.yaml (vit), config/UNet.yaml (unet); "
                       f"{', '.join(other)} configs have settings of their own.", WIDTH),
        "",
        "Spellings kept from the tutorial:",
    ]
    for alias, (target, value) in FLAG_ALIASES.items():
        head.append(f"  --{alias:<22} = --{target} {value_text(value)}")
    for alias, target in SETTING_ALIASES.items():
        head.append(f"  --{alias:<22} = --{target}")
    for (key, alias), target in VALUE_ALIASES.items():
        head.append(f"  --{key} {alias:<{max(1, 21 - len(key))}} = --{key} {target}")
    return "\n".join(head) + "\n" + settings_help(cfg)


def from_argv(argv: list[str], default_yaml: str = DEFAULT_YAML, default_name: str = "quickstart",
              prog: str = "train.py") -> Config:
    """Parse entry-script arguments; configuration errors exit with status 2 and one message."""
    helping = "-h" in argv or "--help" in argv
    try:
        entry, overrides = parse_overrides([a for a in argv if a not in ("-h", "--help")])
        yaml_path = entry.get("yaml_config", default_yaml)
        cfg = build_config(yaml_path, entry.get("config", default_name), overrides)
    except ConfigError as e:
        refuse(str(e))
    if helping:
        print(usage(prog, yaml_path, cfg))
        raise SystemExit(0)
    return cfg
