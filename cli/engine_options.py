"""Click options generated from `EngineConfig`'s fields: one name, help text and check per field,
the same on every command that takes them (`generate`, `serve`, `bench decode|spec`)."""

from __future__ import annotations

import functools
from dataclasses import MISSING, fields

import click

from kvbuffer.engine.config import DTYPES, EngineConfig, SpeculativeConfig

_SPELLED = {"auto": "auto", "true": True, "false": False}


def _spell(value) -> str:
    return "true" if value is True else "false" if value is False else value


def _field(name: str):
    cls = SpeculativeConfig if name.startswith("speculative.") else EngineConfig
    return next(f for f in fields(cls) if f.name == name.rsplit(".", 1)[-1])


def _dest(name: str) -> str:
    return name.replace(".", "_")


def _convert(f, value):
    """The command line's spelling of a field's value -> the config's value, checked (BadParameter)."""
    meta = f.metadata
    if value is None:
        return None
    if meta["kind"] == "switch":
        value = _SPELLED[value]
    elif meta["kind"] == "dtype":
        import torch

        value = getattr(torch, value)
    if meta["check"] is not None:
        try:
            meta["check"](f.name, value)
        except (TypeError, ValueError) as e:
            raise click.BadParameter(str(e)) from None
    return value


def _click_option(name: str, default):
    """The click option of config field `name` (dotted for SpeculativeConfig's), with `default`."""
    f = _field(name)
    meta = f.metadata
    kw = dict(default=default, show_default=default is not None, help=meta["help"],
              callback=lambda ctx, param, value: _convert(f, value))
    kind = meta["kind"]
    if kind == "int":
        kw["type"] = int
    elif kind == "choice":
        kw["type"] = click.Choice(meta["choices"])
    elif kind == "dtype":
        kw["type"] = click.Choice(DTYPES)
    elif kind == "switch":
        kw.update(type=click.Choice(list(_SPELLED)), is_flag=False, flag_value=_spell(meta["bare"]),
                  default=_spell(default), help=f"{meta['help']} {meta['cli'].replace('--', '--no-', 1)}: false.")
    return click.option(meta["cli"], _dest(name), **kw)


def _negation(name: str):
    """`--no-NAME` for a switch: the same as `--NAME false`."""
    return click.option(_field(name).metadata["cli"].replace("--", "--no-", 1), f"no_{_dest(name)}", is_flag=True,
                        hidden=True)


def _options(names: tuple[str, ...]) -> list[str]:
    """Field names with "speculative" expanded into its command-line fields."""
    out = []
    for name in names:
        if name == "speculative":
            out += [f"speculative.{f.name}" for f in fields(SpeculativeConfig) if f.metadata["cli"]]
        else:
            out.append(name)
    return out


def _default(name: str, overrides: dict):
    if name in overrides:
        return overrides[name]
    f = _field(name)
    return f.default if f.default is not MISSING else None


def _speculative(ctx: click.Context, values: dict) -> SpeculativeConfig | None:
    """--speculative and the options that only mean something with it."""
    method = values.pop("method")
    if method is None:
        for name in values:
            if ctx.get_parameter_source(f"speculative_{name}") is click.core.ParameterSource.COMMANDLINE:
                option = _field(f"speculative.{name}").metadata["cli"]
                raise click.UsageError(f"{option} needs --speculative ngram or --speculative mtp")
        return None
    return SpeculativeConfig(method, **{k: v for k, v in values.items() if v is not None})


def engine_options(*names: str, **defaults):
    """Add the click options of these EngineConfig fields ("speculative": --speculative and its
    options) to a command, which then gets `config`, an EngineConfig built from them (a value the
    config refuses is a usage error). `defaults` replace the fields' own defaults on this command."""
    options = _options(names)

    def decorate(command):
        @functools.wraps(command)
        def wrapper(**kwargs):
            ctx = click.get_current_context()
            values, spec = {}, {}
            for name in options:
                value = kwargs.pop(_dest(name))
                if kwargs.pop(f"no_{_dest(name)}", False):
                    value = False
                if name.startswith("speculative."):
                    spec[name.split(".", 1)[1]] = value
                else:
                    values[name] = value
            try:  # a command with two sets of engine options gets one config from both
                if spec:
                    values["speculative"] = _speculative(ctx, spec)
                config = EngineConfig.from_kwargs(kwargs.pop("config", None), **values)
            except (TypeError, ValueError) as e:
                raise click.UsageError(str(e)) from None
            return command(config=config, **kwargs)

        for name in reversed(options):
            if _field(name).metadata["kind"] == "switch":
                wrapper = _negation(name)(wrapper)
            wrapper = _click_option(name, _default(name, defaults))(wrapper)
        return wrapper

    return decorate
