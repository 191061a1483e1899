"""PyTorch's caching-allocator settings (``PYTORCH_ALLOC_CONF``), read as PyTorch reads them.

The settings change what the allocator *reserves*, never what tensors hold.
PyTorch reads ``PYTORCH_ALLOC_CONF`` first and ``PYTORCH_CUDA_ALLOC_CONF``
when the first is not set (c10/core/AllocatorConfig.h), a comma-separated list
of ``key:value`` pairs:

- ``expandable_segments:True`` - one segment per pool that grows by mapping
  pages (2 MiB for the small pool, 20 MiB for the large one) instead of one
  cudaMalloc per segment;
- ``max_split_size_mb:N`` (N >= 20) - cached blocks of N MiB or more are never
  split, serve only requests of N MiB or more, and only within
  ``max_non_split_rounding_mb`` (default 20) of their size;
- ``roundup_power2_divisions:N`` or ``[1024:4,>:8]`` - requests are rounded up
  to one of N steps between two powers of two (per size interval of 1 MiB to
  64 GiB, named by the interval's lower bound in MiB);
- ``garbage_collection_threshold:F`` (0 < F < 1) - before a new segment, free
  old cached segments once reserved passes F of the memory allowed; only in
  effect with ``torch.cuda.set_per_process_memory_fraction``;
- ``backend:cudaMallocAsync`` - CUDA's own pool allocator, which nbmem's
  simulation does not model (the settings above then have no effect).

Keys that change nothing on the device (pinned host memory, lock release) are
accepted and named in :meth:`AllocatorSettings.ignored`. Anything else raises
the ValueError PyTorch would, with the fix.

>>> settings = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
>>> settings.expandable_segments, settings.max_split_size
(True, 134217728)
>>> str(settings)
'expandable_segments:True,max_split_size_mb:128'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AllocatorSettings", "parse_alloc_conf", "settings_from_environment", "settings_from_snapshot",
           "resolve_alloc_conf", "ENVIRONMENT_VARIABLES"]

MIB = 1 << 20
#: kLargeBuffer: the smallest max_split_size_mb and the default max_non_split_rounding_mb (20 MiB)
LARGE_BUFFER_MB = 20
#: roundup_power2_divisions has one value per power-of-two interval from 1 MiB to 64 GiB
INTERVALS = 16
UNLIMITED = (1 << 64) - 1  # max_split_size when not set (SIZE_MAX)

#: Read in this order; the first one set wins (c10/core/AllocatorConfig.h).
ENVIRONMENT_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# Keys PyTorch accepts that change nothing nbmem simulates (host memory, locking, graph capture).
_NO_EFFECT = {
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
}
_KNOWN = {"expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
          "garbage_collection_threshold", "backend"} | _NO_EFFECT


@dataclass(frozen=True)
class AllocatorSettings:
    """The caching allocator's settings that change reserved memory; the defaults are PyTorch's."""

    expandable_segments: bool = False
    #: bytes; blocks this large or larger are never split (UNLIMITED: no limit, the default)
    max_split_size: int = UNLIMITED
    #: bytes; an oversize cached block serves a request only if it is less than this much larger
    max_non_split_rounding: int = LARGE_BUFFER_MB * MIB
    #: one per interval [1, 2) MiB, [2, 4) MiB, ... [32, 64) GiB and above; 0 or 1: no power-of-two rounding
    roundup_power2_divisions: tuple[int, ...] = (0,) * INTERVALS
    #: 0: off; else the fraction of allowed memory past which old cached segments are freed
    garbage_collection_threshold: float = 0.0
    backend: str = "native"
    #: the text these settings were read from, and where ("" and "default" when none)
    text: str = ""
    source: str = "default"
    #: keys given that change nothing on the device
    ignored_keys: tuple[str, ...] = field(default=())

    def divisions(self, size: int) -> int:
        """The roundup_power2_divisions that apply to a request of ``size`` bytes (its power-of-two interval)."""
        index = size.bit_length() - 1 - 20  # log2(size) - log2(1 MiB)
        return self.roundup_power2_divisions[min(max(index, 0), INTERVALS - 1)]

    @property
    def is_default(self) -> bool:
        return str(self) == ""

    def ignored(self) -> tuple[str, ...]:
        """The keys given that nbmem's simulation leaves out because they change no device memory."""
        return self.ignored_keys

    def __str__(self) -> str:
        """The settings that differ from PyTorch's defaults, as PYTORCH_ALLOC_CONF would spell them."""
        parts = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding != LARGE_BUFFER_MB * MIB:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MIB}")
        if any(value > 1 for value in self.roundup_power2_divisions):
            values = self.roundup_power2_divisions
            if len(set(values)) == 1:
                parts.append(f"roundup_power2_divisions:{values[0]}")
            else:
                parts.append("roundup_power2_divisions:[" + ",".join(
                    f"{1 << index}:{value}" for index, value in enumerate(values)) + "]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts)

    def describe(self) -> str:
        """One line for an estimate's notes: which settings the simulated reserved figure assumed, and from where."""
        if self.is_default:
            where = "" if self.source == "default" else f" ({self.source} sets nothing that changes it)"
            return f"the allocator's default settings{where}"
        return f"{self} (from {self.source})"


    def as_snapshot(self) -> dict[str, Any]:
        """The settings as a memory snapshot records them (``allocator_settings``; :func:`settings_from_snapshot`)."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": str(self),
            "max_split_size": -1 if self.max_split_size == UNLIMITED else self.max_split_size,
            "max_non_split_rounding_size": self.max_non_split_rounding,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "roundup_power2_divisions": {str(1 << index): value for index, value in enumerate(self.roundup_power2_divisions)},
        }

    def simulation_notes(self) -> list[str]:
        """What figures simulated under these settings assumed, for a result's notes."""
        return [f"allocated and reserved are simulated by PyTorch's caching-allocator rules: one stream, "
                f"{self.describe()}, no cudaMalloc rounding by the driver; each tensor counts as its block, as "
                "torch.cuda.memory_allocated counts it (a block at most 1 MiB larger than asked is not split; the "
                "settings can make blocks larger)", *self.caveats()]

    def caveats(self) -> list[str]:
        """The settings given that the simulation leaves out, each said with why."""
        notes = []
        if self.garbage_collection_threshold:
            notes.append("garbage_collection_threshold acts only under torch.cuda.set_per_process_memory_fraction, "
                         "which nbmem does not simulate: not applied")
        if self.backend != "native":
            notes.append(f"backend:{self.backend} is not simulated: reserved follows the native caching allocator's rules")
        if self.ignored_keys:
            notes.append(f"{', '.join(self.ignored_keys)} in {self.source} change no device memory: left out")
        return notes


def _tokens(text: str) -> list[str]:
    """PyTorch's ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own; whitespace is dropped."""
    tokens, buffer = [], ""
    for character in text:
        if character in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(character)
        elif not character.isspace():
            buffer += character
    if buffer:
        tokens.append(buffer)
    return tokens


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def parse_alloc_conf(text: str, source: str = "the setting given") -> AllocatorSettings:
    """Read a PYTORCH_ALLOC_CONF string as PyTorch does; raise ValueError naming the fix where PyTorch would refuse it.

    >>> parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]").divisions(300 << 20)
    1
    >>> parse_alloc_conf("max_split_size_mb:10")
    Traceback (most recent call last):
    ...
    ValueError: max_split_size_mb:10 in the setting given is too small: PyTorch requires at least 20 (MiB)
    """
    if not isinstance(text, str):
        raise TypeError(f"alloc_conf must be a string like 'expandable_segments:True', not {type(text).__name__}")
    tokens = _tokens(text)
    values: dict[str, Any] = {}
    ignored: list[str] = []
    position = 0

    def fail(message: str) -> ValueError:
        return ValueError(f"{message} in {source} ({text!r}); PyTorch's form is key:value pairs separated by commas, "
                          "e.g. 'expandable_segments:True,max_split_size_mb:128'")

    def value_after(key: str) -> str:
        nonlocal position
        if position + 2 >= len(tokens) or tokens[position + 1] != ":":
            raise fail(f"{key} has no value")
        position += 2
        return tokens[position]

    def boolean(key: str) -> bool:
        word = value_after(key)
        if word not in ("True", "False"):
            raise ValueError(f"{key}:{word} in {source}: PyTorch reads only True or False (capitalised) here")
        return word == "True"

    def integer(key: str) -> int:
        word = value_after(key)
        try:
            return int(word)
        except ValueError:
            raise ValueError(f"{key}:{word} in {source}: the value must be a whole number (of MiB)") from None

    while position < len(tokens):
        key = tokens[position]
        if key not in _KNOWN:
            known = ", ".join(sorted(_KNOWN - _NO_EFFECT))
            raise ValueError(f"{key!r} in {source} is not a setting PyTorch's allocator knows (it would refuse to start "
                             f"CUDA); the settings that change device memory are: {known}")
        if key == "expandable_segments":
            values[key] = boolean(key)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            megabytes = integer(key)
            if megabytes < LARGE_BUFFER_MB:
                raise ValueError(f"{key}:{megabytes} in {source} is too small: PyTorch requires at least "
                                 f"{LARGE_BUFFER_MB} (MiB)")
            values[key] = megabytes * MIB
        elif key == "garbage_collection_threshold":
            word = value_after(key)
            try:
                threshold = float(word)
            except ValueError:
                threshold = -1.0
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"garbage_collection_threshold:{word} in {source}: PyTorch requires a fraction "
                                 "between 0 and 1, e.g. 0.8")
            values[key] = threshold
        elif key == "roundup_power2_divisions":
            values[key] = _divisions(tokens, position, source, fail)
            position = values[key][1]
            values[key] = values[key][0]
        elif key == "backend":
            word = value_after(key)
            if word not in ("native", "cudaMallocAsync"):
                raise ValueError(f"backend:{word} in {source}: PyTorch's CUDA allocator backends are native and "
                                 "cudaMallocAsync")
            values[key] = word
        else:  # accepted by PyTorch, no effect on what the device reserves
            if position + 1 >= len(tokens) or tokens[position + 1] != ":":
                raise fail(f"{key} has no value")
            position += 2
            if position < len(tokens) and tokens[position] == "[":
                while position < len(tokens) and tokens[position] != "]":
                    position += 1
            ignored.append(key)
        position += 1
        if position < len(tokens):
            if tokens[position] != ",":
                raise fail(f"expected ',' before {tokens[position]!r}")
            position += 1
    return AllocatorSettings(
        expandable_segments=values.get("expandable_segments", False),
        max_split_size=values.get("max_split_size_mb", UNLIMITED),
        max_non_split_rounding=values.get("max_non_split_rounding_mb", LARGE_BUFFER_MB * MIB),
        roundup_power2_divisions=values.get("roundup_power2_divisions", (0,) * INTERVALS),
        garbage_collection_threshold=values.get("garbage_collection_threshold", 0.0),
        backend=values.get("backend", "native"), text=text, source=source, ignored_keys=tuple(ignored),
    )


def _divisions(tokens: list[str], position: int, source: str, fail: Any) -> tuple[tuple[int, ...], int]:
    """roundup_power2_divisions:N (every interval) or [MiB:N,...,>:N] (parseRoundUpPower2Divisions)."""
    if position + 2 >= len(tokens) or tokens[position + 1] != ":":
        raise fail("roundup_power2_divisions has no value")
    position += 2
    divisions = [0] * INTERVALS

    def whole(word: str, what: str) -> int:
        try:
            number = int(word)
        except ValueError:
            raise ValueError(f"roundup_power2_divisions in {source}: {what} {word!r} must be a whole number") from None
        return number

    if tokens[position] != "[":
        number = whole(tokens[position], "the number of divisions")
        if not _power_of_two(number):
            raise ValueError(f"roundup_power2_divisions:{number} in {source}: PyTorch requires a power of two (2, 4, 8...)")
        return (number,) * INTERVALS, position
    first, last_index = True, 0
    position += 1
    while position < len(tokens) and tokens[position] != "]":
        interval = tokens[position]
        if position + 2 >= len(tokens) or tokens[position + 1] != ":":
            raise fail(f"roundup_power2_divisions entry {interval!r} has no value")
        number = whole(tokens[position + 2], "the number of divisions")
        if number != 0 and not _power_of_two(number):
            raise ValueError(f"roundup_power2_divisions in {source}: {number} divisions is not a power of two "
                             "(or 0, which turns rounding off)")
        if interval == ">":
            divisions[last_index:] = [number] * (INTERVALS - last_index)
        else:
            megabytes = whole(interval, "the interval (MiB)")
            if not _power_of_two(megabytes):
                raise ValueError(f"roundup_power2_divisions in {source}: the interval {megabytes} (MiB) must be a power "
                                 "of two, e.g. 256, 512, 1024")
            index = min(megabytes.bit_length() - 1, INTERVALS - 1)
            if first:
                divisions[:index] = [number] * index
                first = False
            divisions[index] = number
            last_index = index
        position += 3
        if position < len(tokens) and tokens[position] == ",":
            position += 1
    if position >= len(tokens):
        raise fail("roundup_power2_divisions' list has no closing ']'")
    return tuple(divisions), position


def settings_from_environment(environment: Mapping[str, str] | None = None) -> AllocatorSettings:
    """The settings this process's CUDA allocator would read: PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF."""
    environment = os.environ if environment is None else environment
    for name in ENVIRONMENT_VARIABLES:
        text = environment.get(name)
        if text:
            return parse_alloc_conf(text, source=name)
    return AllocatorSettings()


def settings_from_snapshot(recorded: Mapping[str, Any]) -> AllocatorSettings:
    """The settings a memory snapshot records (its ``allocator_settings``, torch 2.4 and later)."""
    if not recorded:
        return AllocatorSettings(source="the snapshot (which records none: PyTorch's defaults assumed)")
    split = int(recorded.get("max_split_size", -1) or -1)
    divisions = recorded.get("roundup_power2_divisions") or {}
    if isinstance(divisions, Mapping):
        ordered = tuple(int(divisions.get(str(1 << index), 0) or 0) for index in range(INTERVALS))
    else:
        ordered = (int(divisions or 0),) * INTERVALS
    rounding = int(recorded.get("max_non_split_rounding_size", 0) or 0)
    return AllocatorSettings(
        expandable_segments=bool(recorded.get("expandable_segments", False)),
        max_split_size=UNLIMITED if split < 0 or split >= UNLIMITED else split,
        max_non_split_rounding=rounding or LARGE_BUFFER_MB * MIB,
        roundup_power2_divisions=ordered,
        garbage_collection_threshold=float(recorded.get("garbage_collection_threshold", 0.0) or 0.0),
        text=str(recorded.get("PYTORCH_CUDA_ALLOC_CONF", "") or ""), source="the snapshot",
    )


def resolve_alloc_conf(alloc_conf: Any) -> AllocatorSettings:
    """An ``alloc_conf=`` argument: None (read the environment), a string, or AllocatorSettings."""
    if alloc_conf is None:
        return settings_from_environment()
    if isinstance(alloc_conf, AllocatorSettings):
        return alloc_conf
    return parse_alloc_conf(alloc_conf, source="alloc_conf")
