"""Numeric command-line values with their ranges, for every command's argparse flags: a value out of range (or not
a number) is refused by argparse itself, naming the flag, what is allowed and what was given, with exit code 2."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(kind: type, lo: float | None, hi: float | None, lo_open: bool = False) -> Callable[[str], float]:
    name = "an integer" if kind is int else "a number"
    bounds = []
    if lo is not None:
        bounds.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        bounds.append(f"<= {hi:g}")
    allowed = f"{name} {' and '.join(bounds)}" if bounds else name

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text}")
        return value

    parse.__name__ = allowed  # argparse names the type in its messages
    parse.kind, parse.lo, parse.hi, parse.lo_open = kind, lo, hi, lo_open  # for the tests that probe every flag
    return parse


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    return _number(int, lo, hi)


def float_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    return _number(float, lo, hi, lo_open)


positive_int = int_range(1)
nonnegative_int = int_range(0)
positive_float = float_range(0, lo_open=True)
nonnegative_float = float_range(0)
fraction = float_range(0, 1)  # a ratio in [0, 1]
port = int_range(1, 65535)
seed = int_range(-2 ** 63, 2 ** 64 - 1)  # what a 64-bit generator seed can hold
temperature = float_range(0, 2)  # OpenAI's range
top_p = float_range(0, 1, lo_open=True)
top_k = int_range(-1)  # -1 (and 0): off
threads = int_range(1, 1024)  # torch CPU threads (peagle/threads.py)
