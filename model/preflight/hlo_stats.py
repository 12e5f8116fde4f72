"""Figures read from a compiled program: its memory and cost analyses as `ProgramStats`, the compiler's refusal
when it runs out of HBM, and from the program's text its Mosaic kernel calls and cross-device collectives.
"""

from __future__ import annotations

import functools
import logging
import math
import re

from .estimate import ProgramStats

logger = logging.getLogger(__name__)

MOSAIC_CALL = "tpu_custom_call"


def count_kernel_calls(text: str, source: str = "compiled") -> int:
    """Mosaic kernel calls in a program's text: custom calls in the compiled HLO; in the lowered (StableHLO) text,
    where a kernel sits in a function called from many places, every call site of every function holding one."""
    if source == "compiled":
        return text.count(MOSAIC_CALL)
    calls, current = {}, None
    for line in text.splitlines():
        start = re.match(r"\s*func\.func (?:public |private )?@([^\s(]+)\(", line)
        if start:
            current = calls[start.group(1)] = []
        elif current is not None:
            current.extend(re.findall(r"call @([^\s(]+)\(", line))

    @functools.lru_cache(maxsize=None)
    def kernels(function: str) -> int:
        return sum(1 if c == MOSAIC_CALL else kernels(c) for c in calls.get(function, ()) if c != function)

    return kernels("main")


def program_text(compiled, lowered) -> tuple[str, str]:
    """(text, "compiled") of the optimised program, or (text, "lowered") of the program before XLA's passes when the
    compiled one cannot be printed (libtpu 0.0.52's TPU v7 programs hold async ops this jaxlib cannot read back);
    both hold the Mosaic kernels' custom calls."""
    try:
        return compiled.as_text(), "compiled"
    except Exception as e:  # noqa: BLE001 - a JaxRuntimeError from the HLO proto round trip
        logger.warning("the compiled program cannot be printed (%s); counting Mosaic kernels in the lowered one",
                       str(e).splitlines()[0][:200])
        return lowered.as_text(), "lowered"


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COLLECTIVE_LINE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def collective_traffic(text: str) -> dict:
    """{kind: [ops, bytes]} of the cross-device collectives in a compiled HLO text: each op's result arrays (an async
    op is counted at its -start; its -done carries the same data). Bytes are per device, the data each op moves
    into or out of one device's memory, before the interconnect's own overheads."""
    out: dict = {}
    for line in text.splitlines():
        match = _COLLECTIVE_LINE.search(line)
        if not match or "-done(" in line:
            continue
        result, kind = match.groups()
        if kind + "-start(" in line and result.startswith("("):  # (operand aliases..., result): the last array
            arrays = _ARRAY.findall(result)[-1:]
        else:
            arrays = _ARRAY.findall(result)
        size = sum(_DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
                   for dtype, dims in arrays)
        ops, total = out.get(kind, [0, 0])
        out[kind] = [ops + 1, total + size]
    return out


def is_out_of_hbm(error: Exception) -> bool:
    """Whether a compile error is the TPU compiler finding the program too large for the device's HBM."""
    return "RESOURCE_EXHAUSTED" in str(error) or "HbmOom" in str(error)


_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def refused_program_stats(name, message: str, *, parameter_bytes: int, kernel_flops: float, loop_trips: int,
                          compile_s: float) -> ProgramStats:
    """ProgramStats of a program the compiler refused for lack of HBM: the memory it said was required (its
    parameters included) stands as parameters plus temporaries; FLOPs and seconds are unknown (NaN)."""
    sizes = re.findall(r"\(([\d.]+)([KMGT]?)i?B?\)", message)
    required = int(float(sizes[0][0]) * _SIZE_UNITS[sizes[0][1]]) if sizes else 0
    first = next((line for line in message.splitlines() if "memory" in line or "HBM" in line), message)
    nan = float("nan")
    return ProgramStats(name=name, argument_bytes=int(parameter_bytes), temp_bytes=max(0, required - parameter_bytes),
                        output_bytes=0, alias_bytes=0, parameter_bytes=int(parameter_bytes), flops=nan,
                        bytes_accessed=nan, optimal_seconds=nan, kernel_flops=float(kernel_flops),
                        compile_s=compile_s, mosaic_kernels=0, loop_trips=loop_trips, text_source="none",
                        compile_error=first.strip()[:400])


def program_stats(name, memory, cost, text: str, *, parameter_bytes: int, kernel_flops: float, loop_trips: int,
                  compile_s: float, text_source: str = "compiled") -> ProgramStats:
    """ProgramStats from a compiled program's memory and cost analyses (XLA counts a loop body once: x trips)."""
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    return ProgramStats(
        name=name, argument_bytes=int(memory.argument_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes), alias_bytes=int(memory.alias_size_in_bytes),
        parameter_bytes=int(parameter_bytes), flops=float(cost.get("flops", 0.0)) * loop_trips,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) * loop_trips,
        optimal_seconds=float(cost.get("optimal_seconds", float("nan"))) * loop_trips,
        kernel_flops=float(kernel_flops), compile_s=compile_s, mosaic_kernels=count_kernel_calls(text, text_source),
        loop_trips=loop_trips, text_source=text_source,
        collectives=collective_traffic(text) if text_source == "compiled" else None)
