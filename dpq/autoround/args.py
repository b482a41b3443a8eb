"""The one parser of ``auto-round-dp``: auto-round's own quantize parser (its arguments, help,
usage and error format) with dpq's flags as its ``dpq`` argument group (:data:`dpq.planning.spec.FLAGS`),
under the command's own name.

:func:`parse` reads a command line as that parser does, and names a close match for an
unrecognized flag (``--parallel-quantization``: did you mean ``--parallel_quantization``).
:func:`split_argv` takes dpq's flags out of a command line (auto-round's runner gets the rest and
parses it again itself), :func:`autoround_args` reads auto-round's arguments alone.
"""

from __future__ import annotations

import argparse
import difflib

from dpq import refusals
from dpq.planning.spec import FLAGS, Flag

__all__ = ["GROUP_DESCRIPTION", "add_flags", "autoround_args", "build_parser", "parse", "program", "split_argv"]

GROUP_DESCRIPTION = ("data-parallel tuning: each block tuned on several lanes (devices) at once; off by default "
                     "(plain auto-round)")


def program(recipe: str | None = None) -> str:
    """The command's name: ``auto-round-dp``, or its recipe twin (``auto-round-dp-best``)."""
    return "auto-round-dp" + (f"-{recipe}" if recipe else "")


def add_flags(target, flags: tuple[Flag, ...] = FLAGS) -> None:
    """dpq's flags on ``target`` (a parser or an argument group), as :data:`dpq.planning.spec.FLAGS` says."""
    for flag in flags:
        if flag.choices:
            target.add_argument(flag.option, nargs="?", const=flag.const, default=flag.default, choices=flag.choices,
                                metavar=flag.metavar, help=flag.help)
        elif flag.metavar is None:
            target.add_argument(flag.option, action="store_true", default=flag.default, help=flag.help)
        else:
            target.add_argument(flag.option, default=flag.default, metavar=flag.metavar, help=flag.help)


def build_parser(recipe: str | None = None) -> argparse.ArgumentParser:
    """auto-round's quantize parser named after the command, with the ``dpq`` group."""
    from auto_round.cli.parser import build_quantize_parser

    parser = build_quantize_parser(prog=program(recipe))
    add_flags(parser.add_argument_group("dpq", GROUP_DESCRIPTION))
    return parser


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def close_match(parser: argparse.ArgumentParser, token: str) -> str | None:
    """The flag ``token`` (``--name`` or ``--name=value``) most likely meant, or None: the same name
    with underscores for dashes, else the closest by :func:`difflib.get_close_matches`."""
    name = token.partition("=")[0]
    options = _options(parser)
    underscored = "--" + name.lstrip("-").replace("-", "_")
    if underscored in options:
        return underscored
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.8)
    return found[0] if found else None


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` as ``parser`` reads it; an unrecognized argument stops with argparse's error (usage,
    then ``prog: error: ...``, exit 2), naming the flag meant when one is close."""
    parsed, extras = parser.parse_known_args(argv)
    if extras:
        meant = {t.partition("=")[0]: m for t in extras if t.startswith("-") and (m := close_match(parser, t))}
        parser.error(refusals.unrecognized_arguments(" ".join(extras), list(meant), list(meant.values())))
    return parsed


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(dpq's flags, the rest of ``argv`` in its order). A flag of dpq's may be abbreviated as far as
    it stays unique among the whole parser's (:func:`parse` has refused an ambiguous one)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    return parser.parse_known_args(argv)


def autoround_args(rest: list[str]) -> argparse.Namespace | None:
    """auto-round's arguments ``rest`` as its parser reads them (defaults filled in); None when it
    rejects them (auto-round says why, with its usage, when it parses them itself)."""
    from auto_round.cli.parser import build_quantize_parser

    parser = build_quantize_parser(prog="auto-round-dp")

    def rejected(message: str = "", *args) -> None:
        raise ValueError(message)

    parser.error = parser.exit = rejected
    parser.print_help = parser.print_usage = lambda *a, **k: None  # (--help: the caller's parser says it)
    try:
        return parser.parse_args(rest)
    except ValueError:
        return None
