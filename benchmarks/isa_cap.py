"""``--isa X``: run a benchmark as if the CPU had only instruction set X, peers included.

``KVCACHE_ATTEND_ISA=avx2`` alone caps our kernel and leaves torch's SDPA, oneDNN and MKL on
the machine's best path (on an AVX512-BF16 CPU, bf16 GEMMs at 2.5x the float32 rate), so an
"AVX2" row would race our AVX2 loops against AVX-512 peers: a machine that does not exist.
``--isa X`` sets, before torch is imported, the cap of every library that dispatches on the CPU:

* ``KVCACHE_ATTEND_ISA``: our attend kernel;
* ``ATEN_CPU_CAPABILITY``: ATen's vectorized kernels (softmax, the flash-attention CPU kernel);
* ``ONEDNN_MAX_CPU_ISA``: oneDNN (torch's bf16 matmul);
* ``MKL_ENABLE_INSTRUCTIONS``: MKL (torch's float32 matmul).

These are read when each library loads, so the benchmark re-executes itself with them set
(:func:`apply`, called before ``import torch``). :func:`describe` names the caps in force for the
table headers and the JSON.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

# Per --isa value: the environment that caps each library at it. ATen has no level between
# avx2 and avx512; oneDNN's and MKL's spellings are their documented ones.
CAPS: Dict[str, Dict[str, str]] = {
    "generic": dict(KVCACHE_ATTEND_ISA="generic", ATEN_CPU_CAPABILITY="default",
                    ONEDNN_MAX_CPU_ISA="SSE41", MKL_ENABLE_INSTRUCTIONS="SSE4_2"),
    "avx2": dict(KVCACHE_ATTEND_ISA="avx2", ATEN_CPU_CAPABILITY="avx2",
                 ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2"),
    "avx512": dict(KVCACHE_ATTEND_ISA="avx512", ATEN_CPU_CAPABILITY="avx512",
                   ONEDNN_MAX_CPU_ISA="AVX512_CORE", MKL_ENABLE_INSTRUCTIONS="AVX512"),
}

_MARK = "KVCACHE_BENCH_ISA"  # set in the re-executed process: the cap is in force


def requested(argv: List[str]) -> Optional[str]:
    """The value of ``--isa`` in `argv` (``--isa X`` or ``--isa=X``), or None."""
    for i, a in enumerate(argv):
        if a == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--isa="):
            return a.split("=", 1)[1]
    return None


def apply(argv: Optional[List[str]] = None) -> None:
    """Re-executes this process with the caps of ``--isa`` set, unless they are set already.

    Call before anything imports torch. An unknown value is left to argparse to reject.

    Raises:
        SystemExit: (through argparse, later) for an unknown ``--isa``; os.execv does not return.
    """
    argv = sys.argv if argv is None else argv
    isa = requested(argv[1:])
    if isa is None or isa not in CAPS or os.environ.get(_MARK) == isa:
        return
    env = dict(os.environ, **CAPS[isa])
    env[_MARK] = isa
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)


def add_arg(parser) -> None:
    """The ``--isa`` option of a benchmark's argparse parser."""
    parser.add_argument("--isa", choices=sorted(CAPS), default=None,
                        help="cap our kernel AND the peers (ATen, oneDNN, MKL) at this instruction set, "
                             "as on a CPU that has no more; KVCACHE_ATTEND_ISA alone caps only ours")


def describe() -> str:
    """The library caps in force, for headers: 'none' or 'ATEN_CPU_CAPABILITY=avx2, ...'."""
    names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    set_ = [f"{n}={os.environ[n]}" for n in names if os.environ.get(n)]
    return ", ".join(set_) if set_ else "none (peers on the machine's best path)"
