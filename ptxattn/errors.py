"""Exceptions raised by ptxattn.

Bad *arguments* raise the built-in ValueError/TypeError (naming the argument);
everything that goes wrong below the Python API raises a PtxattnError subclass,
so a caller can tell "I passed something wrong" from "the GPU stack failed".
"""

from __future__ import annotations


class PtxattnError(RuntimeError):
    """Base class for failures of the GPU stack (driver, JIT, launch)."""


class NoGpuError(PtxattnError):
    """No usable CUDA GPU: no driver library, cuInit failed, or no device.

    Always one line, so that a CLI or a test skip reason can print it as is.
    """


class CudaError(PtxattnError):
    """A driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, result: int, call: str, name: str | None = None,
                 description: str | None = None):
        self.result = int(result)
        self.call = call
        self.name = name or _result_name(self.result)
        self.description = description if description is not None else _describe(self.result)
        super().__init__(f"{call} failed: {self.name} ({self.result}): {self.description}")


class JitError(PtxattnError):
    """The driver JIT rejected a PTX module.

    `log` is the raw error log; `annotated` is the same log with each
    `line N` pointing back to the stage file (or include) and its source text;
    `locations` lists those (file, line, text) triples, first error first.
    """

    def __init__(self, label: str, result_name: str, log: str, annotated: str,
                 locations: list[tuple[str, int, str]] | None = None):
        self.label = label
        self.result_name = result_name
        self.log = log
        self.annotated = annotated
        self.locations = list(locations or [])
        where = ""
        if self.locations:
            file, line, _ = self.locations[0]
            where = f" at {file}:{line}"
        body = annotated.strip() or "(the JIT wrote no error log)"
        super().__init__(f"JIT compile of {label} failed ({result_name}){where}:\n{body}")


def _result_name(result: int) -> str:
    # The enum lives in cuda.bindings, which may be missing: fall back to the number.
    try:
        from cuda.bindings import driver as cu
        return cu.CUresult(result).name
    except Exception:
        return f"CUresult {result}"


def _describe(result: int) -> str:
    """The driver's own sentence for an error, when the driver can be asked."""
    try:
        from cuda.bindings import driver as cu
        err, text = cu.cuGetErrorString(cu.CUresult(result))
        if int(err) == 0 and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass  # no libcuda (CPU machine) or an unknown code: the name has to do
    return "no description available from the driver"
