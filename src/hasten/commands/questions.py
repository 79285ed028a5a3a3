"""Asking questions in the terminal: numbered choices, defaults in brackets, bad answers re-asked.

Plain ``input()`` so that it works in any terminal, over ssh, and with answers piped on stdin.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

from .config_schema import BadValue, Key, coerce
from .errors import HastenCLIError


class Asker:
    """Asks one question at a time; every answer is checked and re-asked until it is valid."""

    def __init__(self, read: Optional[Callable[[str], str]] = None, write: Optional[Callable[[str], None]] = None,
                 max_tries: int = 20) -> None:
        self._read = read or input
        self._write = write or (lambda text: print(text, file=sys.stdout))
        self.max_tries = max_tries

    def _ask(self, prompt: str, parse: Callable[[str], Any]) -> Any:
        for _ in range(self.max_tries):
            try:
                answer = self._read(prompt)
            except EOFError:
                raise HastenCLIError(
                    f"the input ended before this question was answered: {prompt.strip()} "
                    "(answer every question, or use `hasten config default`)"
                ) from None
            try:
                return parse(answer.strip())
            except BadValue as exc:
                self._write(f"  {exc}")
        raise HastenCLIError(f"no valid answer to {prompt.strip()!r} after {self.max_tries} tries")

    def choice(self, question: str, options: Sequence[tuple[Any, str]], default: Any = None,
               refuse: Optional[dict[Any, str]] = None) -> Any:
        """A numbered menu; the answer is a number or an option's name. ``refuse``: value -> reason."""
        values = [v for v, _ in options]
        default_index = values.index(default) + 1 if default in values else None
        self._write(question)
        for i, (_, label) in enumerate(options, 1):
            self._write(f"  {i}) {label}")
        hint = f" [{default_index}]" if default_index else ""

        def parse(text: str) -> Any:
            if not text and default_index:
                picked = values[default_index - 1]
            elif text.isdigit() and 1 <= int(text) <= len(values):
                picked = values[int(text) - 1]
            else:
                by_name = [v for v, label in options if text.lower() in (str(v).lower(), label.lower())]
                if not by_name:
                    raise BadValue(f"please answer with a number from 1 to {len(values)}")
                picked = by_name[0]
            if refuse and picked in refuse:
                raise BadValue(refuse[picked])
            return picked

        return self._ask(f"Choose 1-{len(values)}{hint}: ", parse)

    def yes_no(self, question: str, default: bool) -> bool:
        key = Key("answer", "bool")

        def parse(text: str) -> bool:
            if not text:
                return default
            return coerce(key, text)

        return self._ask(f"{question} [{'yes' if default else 'no'}]: ", parse)

    def number(self, question: str, default: Optional[float], kind: str = "int", minimum: Optional[float] = None,
               maximum: Optional[float] = None, check: Optional[Callable[[Any], Optional[str]]] = None) -> Any:
        key = Key("answer", kind, minimum=minimum, maximum=maximum)

        def parse(text: str) -> Any:
            if not text:
                if default is None:
                    raise BadValue("an answer is needed")
                value = default
            else:
                value = coerce(key, text)
            problem = check(value) if check else None
            if problem:
                raise BadValue(problem)
            return value

        shown = f" [{default:g}]" if isinstance(default, float) else (f" [{default}]" if default is not None else "")
        return self._ask(f"{question}{shown}: ", parse)

    def text(self, question: str, default: Optional[str] = None, check: Optional[Callable[[str], Any]] = None,
             allow_empty: bool = False) -> Optional[str]:
        def parse(text: str) -> Any:
            if not text:
                if default is not None:
                    text = default
                elif allow_empty:
                    return None
                else:
                    raise BadValue("an answer is needed")
            return check(text) if check else text

        shown = f" [{default}]" if default else ""
        return self._ask(f"{question}{shown}: ", parse)
