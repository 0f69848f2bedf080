"""The engine's command-line flags, shared by ``tpuserve generate`` (tpuserve/cli.py) and ``tpuserve
serve`` (server/api_server.py): one --flag per ``EngineConfig`` field, spelled as vLLM spells it."""

from __future__ import annotations

import argparse
from typing import Any

from tpuserve.tpu_platform.config import EngineConfig

# Engine flags that are not command-line flags (the model is a positional argument).
_NOT_FLAGS = {"model"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per engine config field, spelled as vLLM spells it (--max-model-len, ...)."""
    group = parser.add_argument_group("engine")
    for name, (kind, _default) in EngineConfig.flag_fields().items():
        if name in _NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        kind = kind.split("|")[0].strip()  # annotations are strings: "int | None", "bool", ...
        if kind == "bool":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(
                flag,
                dest=name,
                default=None,
                type={"int": int, "float": float}.get(kind, str),
                metavar="JSON" if kind == "json" else None,
            )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the command line set (unset ones stay None and are left to the config)."""
    names = set(EngineConfig.flag_fields()) - _NOT_FLAGS
    return {k: v for k, v in vars(args).items() if k in names and v is not None}
