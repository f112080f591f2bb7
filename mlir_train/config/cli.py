"""Megatron/AIAK-compatible command line for ``python -m mlir_train.sft``.

The flags are the fields of :mod:`mlir_train.config.flags` (one place for the parser, the
``--help`` groups and the flag table); this module turns a command line (and an optional
``--config FILE``) into a :class:`~mlir_train.config.flags.RunConfig`. Every flag of the user's
Megatron script (seed: ``qwen3_30b_a3b_sft_megatron_aiak.txt``) is accepted under Megatron's
name, type and default, in a ``--help`` group named after the seed's bash array that carries it.

Three kinds of accepted flags (``flag_table`` explains each): honoured fields; flags that mean
nothing under JAX/XLA or restate the Qwen3 architecture (accepted with Megatron's arity, not
stored, printed once by the trainer; an architecture flag whose value contradicts Qwen3, e.g.
``--normalization LayerNorm``, is an error); and refused values (a Megatron feature we do not
implement: exit 2 naming the flag). Anything else is an error naming the closest known flag.

``--config FILE`` (YAML or JSON) holds flags as keys, with dashes or underscores, optionally
nested one level under group names (``training: {lr: 1e-5}``); the command line wins over it.
``--config demo`` is the no-argument job's flags (:mod:`mlir_train.config.demo`), changed the same
way: ``--config demo --lora-dim 8`` is a LoRA run of the demo. A flag on the command line also
replaces the file's flag it cannot run with (``--lr-warmup-fraction`` the file's
``--lr-warmup-iters``, ``--fp16`` its ``--bf16``).

This module imports no jax, so entry points may use it first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterable, Sequence

from mlir_train.config import demo
from mlir_train.config.fields import GROUP_TITLES, SEED_GROUPS
from mlir_train.config.flag_table import (ARCH_IMPLIED_FLAGS, FP8_WHY, NOOP_FLAG_GROUPS, NOOP_FLAGS, NOT_IMPLEMENTED_FLAGS,
                                          is_low_precision_flag)
from mlir_train.config.flags import REQUIRED, RunConfig, build
from mlir_train.config.sections import section_fields
from mlir_train.runtime.errors import ConfigError, read_text

__all__ = ["parse", "build_parser", "flag_value", "FLAG_GROUPS", "ALL_FLAGS", "SEED_GROUPS", "GROUP_TITLES"]

PROG = "mlir-train-sft"

_IGNORED_DEST = "_mlir_train_ignored_flags"


class _IgnoredAction(argparse.Action):
    """Accepts a Megatron flag, checks its value where the architecture fixes it, and records
    the flag name (not its value) so the trainer can report it once."""

    def __init__(self, option_strings, dest, allowed=None, **kwargs):
        self.allowed = allowed
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.allowed is not None and values not in self.allowed:
            parser.error(
                f"{option_string} {values}: mlir-train implements the Qwen3 architecture, which "
                f"fixes {option_string} to {' or '.join(self.allowed)}"
            )
        seen = getattr(namespace, _IGNORED_DEST, None)
        if seen is None:
            seen = []
            setattr(namespace, _IGNORED_DEST, seen)
        if option_string not in seen:
            seen.append(option_string)


def _hidden_default(action: argparse.Action) -> bool:
    return action.nargs == 0 or any(action.default is v for v in (None, False, argparse.SUPPRESS))


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless it is None/False or the help text already explains it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" not in text
            and not _hidden_default(action)
        ):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    error_context = ""

    def error(self, message):
        message = " ".join(str(message).split())  # one line, whatever the message (YAML errors span several)
        self.exit(2, f"{self.prog}: error: {self.error_context}{message}\n")


class _RefusedAction(argparse.Action):
    """A Megatron flag of a feature we do not implement: stops the run naming it."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs):
        self.why = why
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def _arity(nargs: int | str):
    return {0: 0, 1: None}.get(nargs, nargs)


def _literal(text: str) -> str:
    """Help text shown as written: argparse reads ``%`` as a format specifier (``1%``)."""
    return text.replace("%", "%%")


def _add_ignored(group, flag: str, nargs: int, allowed=None, help_text=None) -> None:
    group.add_argument(
        flag,
        action=_IgnoredAction,
        nargs=_arity(nargs),
        allowed=allowed,
        metavar="VALUE" if nargs else None,
        help=_literal(help_text or "ignored under JAX"),
    )


def _field_help(flag: str, text: str | None) -> str | None:
    """A field's help, literal, with what :data:`~mlir_train.config.flags.REQUIRED` says of it."""
    text = None if text is None else _literal(text)
    if flag in REQUIRED:
        return f"{text} ({REQUIRED[flag]})" if text else REQUIRED[flag]
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        usage=f"{PROG} [--config FILE] [Megatron-style flags ...]   (see --help)",
        description="Qwen3 / Qwen3-MoE supervised fine-tuning in JAX, with Megatron-LM/AIAK flags.",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    groups = {name: p.add_argument_group(title) for name, title in GROUP_TITLES.items()}
    for _, cls, field, fl in section_fields():
        kwargs = dict(fl.kwargs)
        kwargs["help"] = _field_help(fl.name, kwargs.get("help"))
        if kwargs.get("action") not in ("store_true", "store_false"):
            kwargs.setdefault("default", field.default)
        else:
            kwargs["default"] = field.default
        groups[fl.group or cls.GROUP].add_argument(*fl.names, dest=field.name, **kwargs)
        if fl.name == "--model-name":
            for flag, (nargs, allowed) in ARCH_IMPLIED_FLAGS.items():
                _add_ignored(groups["model"], flag, nargs, allowed,
                             "accepted; the Qwen3 architecture already implies it"
                             + (f" (only {'/'.join(allowed)})" if allowed else ""))
    for flag, (nargs, why) in NOOP_FLAGS.items():
        _add_ignored(groups[NOOP_FLAG_GROUPS.get(flag, "ignored")], flag, nargs, help_text=f"no effect: {why}")
    for flag, (nargs, why) in NOT_IMPLEMENTED_FLAGS.items():
        groups["refused"].add_argument(flag, action=_RefusedAction, nargs=_arity(nargs), why=why,
                                       metavar="VALUE" if nargs else None, help=_literal(f"refused: {why}"))
    for action in p._actions:
        if action.help is None and not _hidden_default(action):
            action.help = "default: %(default)s"
    return p


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}


def flag_groups(parser: argparse.ArgumentParser | None = None) -> dict[str, list[str]]:
    """Group name (``model``, ``data``, ...) -> the long flags in that group."""
    parser = parser or build_parser()
    by_title = {title: name for name, title in GROUP_TITLES.items()}
    out: dict[str, list[str]] = {}
    for grp in parser._action_groups:
        if grp.title in by_title:
            out[by_title[grp.title]] = [
                o for a in grp._group_actions for o in a.option_strings if o.startswith("--")
            ]
    return out


FLAG_GROUPS: dict[str, list[str]] = flag_groups()
ALL_FLAGS: frozenset[str] = frozenset(f for flags in FLAG_GROUPS.values() for f in flags)


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
    neighbouring characters, each one slip of the keyboard."""
    before, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], before[j - 2] + 1)
        before, prev = prev, cur
    return prev[-1]


def _slips(n: int) -> int:
    """Typing slips allowed in a name of ``n`` characters."""
    return 1 if n < 12 else 2 if n < 24 else 3


def _misspelt(flag: str, known: str) -> bool:
    """Whether ``flag`` is a misspelling of ``known`` (both without the leading dashes), not
    another flag: a few slips in all, and every word that differs a misspelling of the word in
    its place (``--fp8-format`` is not ``--ckpt-format``, ``--lora-dim`` not ``--load``, and a
    short word such as ``fp8`` / ``dim`` is never a slip of another)."""
    distance = _edit_distance(flag, known)
    if distance == 0 or (distance == 1 and len(flag) >= 4):  # one slip, a dash dropped or added included
        return True
    words, known_words = flag.split("-"), known.split("-")
    if len(flag) < 4 or distance > _slips(len(flag)) or len(words) != len(known_words):
        return False
    return all(w == k or (len(w) >= 4 and w[0] == k[0] and _edit_distance(w, k) <= _slips(len(w)))
               for w, k in zip(words, known_words))


def _closest(flag: str, known: Iterable[str]) -> str | None:
    """The known flag ``flag`` most likely misspells, or None when none is really close (a peer's
    flag we do not have gets no suggestion rather than an unrelated one)."""
    name = flag.lstrip("-").lower().replace("_", "-")
    candidates = [(_edit_distance(name, k.lstrip("-")), k) for k in known
                  if _misspelt(name, k.lstrip("-").lower().replace("_", "-"))]
    return min(candidates)[1] if candidates else None


def _unknown_flag_message(flag: str, known: Iterable[str], where: str = "") -> str:
    if is_low_precision_flag(flag):
        return f"{flag}{where}: {FP8_WHY}"
    best = _closest(flag, known)
    hint = f"; did you mean {best}?" if best else "; see --help for the accepted flags"
    return f"unknown flag {flag}{where}{hint}"


def _load_config_file(path: str) -> dict[str, Any]:
    text = read_text(path, ConfigError, f"--config {path}")
    if not text.strip():
        raise ConfigError(f"--config {path}: the file is empty; expected a mapping of flag: value")
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError, both carry line info
        raise ConfigError(f"--config {path}: cannot parse: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag: value")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and str(key).replace("_", "-") in GROUP_TITLES:
            flat.update(value)  # one level of grouping, mirroring the seed's arrays
        else:
            flat[str(key)] = value
    return flat


def _config_to_argv(parser: argparse.ArgumentParser, cfg: dict[str, Any], path: str) -> list[str]:
    """Turn config keys into command-line tokens so argparse applies types, choices and arity."""
    actions = _option_actions(parser)
    by_norm = {opt.replace("_", "-"): opt for opt in actions}
    by_dest = {a.dest: opt for opt, a in actions.items() if a.dest != argparse.SUPPRESS}
    argv: list[str] = []
    for key, value in cfg.items():
        flag = by_norm.get("--" + key.lstrip("-").replace("_", "-"))
        negate = False
        if flag is None and key in by_dest:
            # A dest name such as check_for_nan_in_loss_and_grad: false -> --no-check-...
            flag = by_dest[key]
            negate = isinstance(actions[flag], argparse._StoreFalseAction)
        if flag is None:
            parser.error(_unknown_flag_message("--" + key.replace("_", "-"), actions, f" in {path}"))
        if flag == "--config":
            parser.error(f"--config {path}: a config file cannot name another --config")
        action = actions[flag]
        if value is None:
            continue
        if action.nargs == 0:
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} is a switch; give true or false, not {value!r}")
            if value != negate:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if action.nargs not in ("+", "*"):
                parser.error(f"--config {path}: {key} takes one value, not a list")
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag V`` or ``--flag=V``) before parsing: for the
    few settings that must be known before jax is imported or the config file is read.
    (This module imports no jax, so entry points may use it first.)"""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


# A flag on the command line replaces the --config flags it cannot run together with.
_REPLACES = {"--lr-warmup-fraction": ("--lr-warmup-iters",), "--lr-warmup-iters": ("--lr-warmup-fraction",),
             "--fp16": ("--bf16",), "--bf16": ("--fp16",)}


def _config_argv(parser: argparse.ArgumentParser, name: str) -> list[str]:
    """``--config NAME``'s flags: the demo's (``--config demo``), or a file's."""
    if name == demo.NAME:
        return list(demo.FLAGS)
    try:
        loaded = _load_config_file(name)
    except ConfigError as e:
        hint = "" if os.path.exists(name) else f" (--config {demo.NAME} is the no-argument job's flags)"
        parser.error(f"{e}{hint}")
    return _config_to_argv(parser, loaded, name)


def _replaced_by(argv: Sequence[str]) -> set[str]:
    return {old for tok in argv for old in _REPLACES.get(tok.split("=", 1)[0], ())}


def _without(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` less ``flags`` and their values (the tokens up to the next ``--flag``)."""
    out, dropping = [], False
    for tok in argv:
        if tok.startswith("--"):
            dropping = tok.split("=", 1)[0] in flags
        if not dropping:
            out.append(tok)
    return out


def _check_unknown(parser: argparse.ArgumentParser, extras: list[str], where: str = "") -> None:
    if not extras:
        return
    known = _option_actions(parser)
    flag = next((tok.split("=", 1)[0] for tok in extras if tok.startswith("-")), None)
    if flag is None:
        parser.error(f"unexpected argument{where}: {' '.join(extras)}")
    parser.error(_unknown_flag_message(flag, known, where))


def parse(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse Megatron-style flags (and an optional ``--config FILE``) into a RunConfig.

    ``RunConfig.ignored_flags`` lists the accepted no-op flags given, in order of first
    appearance. Exits with status 2 on unknown flags, bad values, flags that cannot run
    together and refused values, naming the flag.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    file_argv: list[str] = []
    config_path = flag_value(argv, "--config")
    if config_path is not None:
        file_argv = _without(_config_argv(parser, config_path), _replaced_by(argv))
        # Parse the file's flags alone first so a bad value is reported against the file.
        parser.error_context = f"--config {config_path}: "
        _, extras = parser.parse_known_args(file_argv)
        _check_unknown(parser, extras, f" in {config_path}")
        parser.error_context = ""
    ns, extras = parser.parse_known_args(file_argv + argv)
    _check_unknown(parser, extras)
    ignored = tuple(getattr(ns, _IGNORED_DEST, None) or ())
    values = {k: v for k, v in vars(ns).items() if k != _IGNORED_DEST}
    try:
        return build(values, ignored)
    except ConfigError as e:
        parser.error(str(e))
