"""Start-up's Triton kernels compiled side by side, not one by one as launches first meet them.

A fresh machine (an empty Triton cache) compiles some forty kernel specialisations while the
runner sizes its pool and captures its graphs; each launch that meets a new one waits for
its compile, so they add up in series. `compile_ahead()` turns a rehearsal of that work into
a list of what it would compile, then compiles the list on a pool of threads (Triton's
`AsyncCompileMode`; its MLIR, LLVM and ptxas stages run without the GIL), and the work
itself, repeated after the block, finds every kernel compiled.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from triton import knobs
from triton.runtime._async_compile import AsyncCompileMode

MAX_WORKERS = 16  # compile threads at most (each holds one kernel's MLIR and LLVM modules)


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Inside the block, a launch whose kernel is not compiled for its arguments yet launches
    nothing and records what it would compile; launches of compiled kernels run as usual. So
    the block is for a rehearsal whose results are thrown away (every tensor a skipped kernel
    would write keeps what it held). On leaving it normally, each recorded specialisation
    compiles once, `workers` at a time, before the block's exit returns. A compile that
    fails here is dropped: the real launch compiles it again and raises where its caller
    can handle it. Under the interpreter (no compiles) the rehearsal simply runs.

    One thread rehearses at a time: Triton's compile hook is process-wide."""
    pending: dict[tuple[int, str], tuple[object, str]] = {}

    def record(*, key, fn, compile, **_) -> bool:
        function = fn.jit_function
        pending.setdefault((id(function), key), (function, compile["specialization_data"]))
        return True  # handled: Triton compiles nothing now and launches nothing

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, record
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous
    if not pending:
        return
    with (
        ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="triton-compile") as pool,
        AsyncCompileMode(pool, ignore_errors=True),
    ):
        for function, specialization in pending.values():
            function.preload(specialization)  # type: ignore[attr-defined]  # a triton JITFunction
