"""argparse, as the ``distlab`` command uses it: a did-you-mean for a misspelled subcommand, choice or flag
(argparse's own ``suggest_on_error`` arrives in Python 3.14), and ``--help`` that shows each default."""
from __future__ import annotations

import argparse
import difflib
import re


class Parser(argparse.ArgumentParser):
    """argparse, with a did-you-mean for a misspelled subcommand, choice or flag."""

    def error(self, message: str):
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), quote=True)
        return super().error(message)

    def refuse_unknown(self, extra: list[str]):
        """``unrecognized arguments: --stratgy ddp (did you mean --strategy?)``, from this (sub)parser."""
        flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        hints = "".join(did_you_mean(a.split("=", 1)[0], flags) for a in extra if a.startswith("-"))
        self.error(f"unrecognized arguments: {' '.join(extra)}{hints}")


def did_you_mean(word: str, options: list[str], quote: bool = False) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each default, except where there is none (None, False: a flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)
