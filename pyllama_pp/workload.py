"""What a user will run, as fit plans memory for it and `run` / `ab --workload` run it in one context: a `Workload`
is a sequence of steps, a prompt ("pp", tokens) or tokens decoded one by one ("tg", tokens). Named ones are in
pyllama_pp.defaults.WORKLOADS (chat, prompt, decode, mixed); "pp=N,tg=N" is a prompt of N tokens then N decoded; `ab`
and `run` plan for their own tests (`Workload.of_tests`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

from .defaults import FIT, WORKLOADS
from .errors import ConfigError

_EXPLICIT = re.compile(r"\s*(pp|tg)\s*=\s*(\d+)\s*")


@dataclass(frozen=True)
class Workload:
    """Steps a user runs, in order, and the name they were asked by.

    Attributes:
        steps: ("pp" | "tg", tokens) each.
        name: a name of WORKLOADS, "pp=N,tg=N", or "tests" (a run's own tests).
        untimed: prompts ("pp", tokens) the run processes but does not time (a test's depth, -d): they form
            LAYER_MAJOR's groups, but no plan trades the timed steps' speed for theirs.
    """

    steps: tuple
    name: str = ""
    untimed: tuple = ()

    @staticmethod
    def parse(value: Union[str, "Workload", None] = None) -> "Workload":
        """The workload `value` names: a Workload (as it is), None (fit's default), a name of WORKLOADS or
        "pp=N,tg=N" (either part may be left out; 0 drops it).

        Raises:
            ConfigError: for a value that is none of these, or one with no token at all.
        """
        if isinstance(value, Workload):
            return value
        text = str(FIT.workload if value is None else value).strip()
        if text in WORKLOADS:
            return Workload(tuple((k, int(n)) for k, n in WORKLOADS[text]), text)
        parts = [_EXPLICIT.fullmatch(p) for p in text.split(",")]
        if not all(parts) or len({m.group(1) for m in parts}) != len(parts):
            raise ConfigError(f"workload {text!r}: give one of {', '.join(WORKLOADS)} or pp=N,tg=N (a prompt of N "
                              "tokens, then N decoded; e.g. pp=4096,tg=512)")
        steps = tuple((m.group(1), int(m.group(2))) for m in sorted(parts, key=lambda m: m.group(1)) if int(m.group(2)))
        if not steps:
            raise ConfigError(f"workload {text!r} has no token: give a prompt (pp=N) or decoded tokens (tg=N), N > 0")
        return Workload(steps, text)

    @staticmethod
    def of_tests(pp: Sequence[int] = (), tg: Sequence[int] = (), depths: Sequence[int] = ()) -> "Workload":
        """A run's own tests as the workload it plans for: each prompt, then each decode (llama-bench's -p / -n); each
        depth (-d) a prompt processed before its test and not timed."""
        steps = tuple(("pp", int(n)) for n in pp if n) + tuple(("tg", int(n)) for n in tg if n)
        if not steps:
            raise ConfigError("a run with no test (-p 0 -n 0) has no workload to plan for: give -p or -n")
        return Workload(steps, "tests", tuple(("pp", int(n)) for n in depths if n))

    @property
    def longest_prompt(self) -> int:
        """The longest prompt the run processes, timed or not (LAYER_MAJOR's groups form in any)."""
        return max((n for k, n in self.steps + self.untimed if k == "pp"), default=0)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt step."""
        return sum(n for k, n in self.steps if k == "pp")

    @property
    def decode_tokens(self) -> int:
        """Tokens of every decode step."""
        return sum(n for k, n in self.steps if k == "tg")

    def seconds(self, prompt_ts: float, decode_ts: float) -> float:
        """Seconds the workload takes at `prompt_ts` and `decode_ts` tokens/s (a phase with no token costs nothing).

        Args:
            prompt_ts: prompt tokens/s.
            decode_ts: decoded tokens/s.
        Returns:
            seconds.
        """
        pp, tg = self.prompt_tokens, self.decode_tokens
        return (pp / prompt_ts if pp else 0.0) + (tg / decode_ts if tg else 0.0)

    def as_list(self) -> list:
        """The steps as lists (the worker's workload job and the JSON of a plan)."""
        return [[k, n] for k, n in self.steps]

    def __str__(self) -> str:
        steps = ", ".join(f"{k}{n}" for k, n in self.steps)
        return steps if self.name in ("", "tests") or self.name.startswith(("pp=", "tg=")) else f"{self.name} ({steps})"


__all__ = ["Workload"]
