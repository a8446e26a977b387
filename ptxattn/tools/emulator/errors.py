"""What the emulator reports: errors that stop a run, and hazards it records.

Every message names the instruction (PTX line and text), the pc, the CTA, the warp and, where
one lane is at fault, the lane and the address: enough to find the bug without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


class EmulatorError(RuntimeError):
    """A run stopped: the kernel did something the hardware would fault on or leave undefined
    (out-of-bounds or misaligned access, a divergent collective, a bad mbarrier operation), or
    PTX the emulator does not implement."""


class ParseError(EmulatorError):
    """The PTX text could not be read."""


class Unsupported(EmulatorError):
    """Valid PTX that the emulator does not implement (yet)."""


class MemoryFault(EmulatorError):
    """An access outside every allocation, outside the CTA's shared memory, or misaligned."""

    def __init__(self, message: str, lane: int | None = None, address: int | None = None):
        super().__init__(message)
        self.lane = lane
        self.address = address


class SyncError(EmulatorError):
    """A barrier, mbarrier, collective or setmaxnreg used against its rules."""


class Deadlock(EmulatorError):
    """No warp can make progress; the message lists each live warp's pc and what it waits on."""


class Livelock(Deadlock):
    """The run went on past its instruction budget: warps spin without finishing."""


class HazardError(EmulatorError):
    """Raised at the end of a run (or at the first hazard with strict=True) when hazards were
    recorded; `.hazards` holds them all."""

    def __init__(self, hazards):
        self.hazards = list(hazards)
        head = f"{len(self.hazards)} hazard(s) recorded"
        body = "\n".join(h.describe() for h in self.hazards[:20])
        more = "" if len(self.hazards) <= 20 else f"\n... and {len(self.hazards) - 20} more"
        super().__init__(f"{head}:\n{body}{more}")


@dataclass
class Hazard:
    """A race the emulator proved possible: the kind, what and where."""
    kind: str            # "wgmma-operand-written", "unfenced-async-read", "tma-overwrite", ...
    message: str
    where: str           # instruction and position

    def describe(self) -> str:
        return f"[{self.kind}] {self.message}\n    {self.where}"
