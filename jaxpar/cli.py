"""What jaxpar's command lines share: one-line errors for bad flags and `--config.KEY=VALUE` overrides.

Kept free of JAX imports: entry points check their flags before JAX starts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from jaxpar.errors import ConfigError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ConfigError line (no usage block), like every other mistake."""

    def __init__(self, *args, usage_hint: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint

    def error(self, message: str):
        raise ConfigError(f"{message}; usage: {self.prog} {self.usage_hint}")


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The parser's flags, and every `--config.KEY=VALUE` as `KEY=VALUE`; anything else is an error."""
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        if not item.startswith("--config."):
            raise ConfigError(f"unknown argument '{item}'; config keys are set as --config.KEY=VALUE")
        if "=" not in item:
            raise ConfigError(f"'{item}' has no value; write {item}=VALUE (one argument, with '=')")
        overrides.append(item[len("--config."):])
    return args, overrides


def main_with_one_line_errors(run: Callable[[list[str]], int], argv: list[str] | None) -> int:
    """Run an entry point; a ConfigError becomes `jaxpar: error: ...` on one line and exit code 2. A
    reader that stops early (`... | head`) ends the output quietly, as for any Unix tool."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        message = " ".join(str(err).splitlines())  # always exactly one line
        print(f"jaxpar: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        sys.stdout = None  # the interpreter's final flush would raise again
        return 0
