"""Benchmark cases for ``benchmarks/``: those of ``python -m mxfp4x bench``
(``mxfp4x._measure.bench``: model-like layers, the floors of a case from the machine's
roofs, a torch matmul roof, torch on experts decoded ahead of time), and the performance
targets ``benchmarks/`` holds each case to (the command shows a user the floors, not our
targets), and the timing of several sides against each other in one benchmark."""
import time

from .._measure.bench import (
    SHAPES,
    Predecoded,
    available_memory,
    best_time,
    floors,
    flops,
    make_experts,
    make_tokens,
    matmul_roof,
    predecoded_time,
    streamed_bytes,
)

__all__ = ["SHAPES", "Predecoded", "available_memory", "best_time", "flops", "floors",
           "make_experts", "make_tokens", "matmul_roof", "predecoded_time", "streamed_bytes",
           "TARGETS", "BIG_T", "verdict", "alternating"]

# The targets, by the host's best ISA: T = 1 against the read floor, T = 2..256
# against floor(T), T >= 512 in float32 against decoded torch.matmul and the FMA peak.
TARGETS = {"avx512": {"t1_vs_read": 1.3, "mid_vs_floor": 1.5},
           "other": {"t1_vs_read": 2.0, "mid_vs_floor": 2.0}}
BIG_T = 512


def verdict(tokens, dtype, time_s, fl, matmul_s, isa):
    """(target text, met) of one case; met is None where the case is judged across cases
    by the callers (bfloat16 against float32, 2 threads against 1)."""
    tg = TARGETS["avx512" if isa in ("avx512", "amx", "avx512bf16") else "other"]
    if tokens == 1:
        return f"<= {tg['t1_vs_read']} x read floor", time_s <= tg["t1_vs_read"] * fl[
            "read_floor_s"]
    if tokens < BIG_T:
        return f"<= {tg['mid_vs_floor']} x floor(T)", time_s <= tg["mid_vs_floor"] * fl[
            "floor_s"]
    if dtype != "float32":
        return "(judged against float32 at the same T)", None
    fma_share = fl["fma_floor_s"] / time_s
    return ("<= 1.0 x matmul, >= 70 % FMA peak",
            time_s <= matmul_s and fma_share >= 0.70)


def alternating(sides, calls, after=None):
    """``(run, times)``: ``run`` for pytest-benchmark's pedantic mode, timing several sides
    against each other in one benchmark, and ``times`` (side -> seconds of each of its
    calls, the warm-up round's first).  Each round calls every side once (``sides``: name
    -> fn(call)) on the round's entry of ``calls``, in an order reversed every other round
    (no side always runs on the cache another left, and a noisy machine slows all alike),
    and ``after()``, untimed, after each call."""
    times = {name: [] for name in sides}
    state = {"i": 0}

    def run():
        i = state["i"]
        state["i"] += 1
        c = calls[i % len(calls)]
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for name in order:
            t0 = time.perf_counter()
            sides[name](c)
            times[name].append(time.perf_counter() - t0)
            if after is not None:
                after()
    return run, times
