"""llama.cpp's own quantizer on a GGUF file, through llama-cpp-python's bindings.

``llama_model_quantize`` is what the ``llama-quantize`` tool runs: the K-quant mixes (Q4_K_M keeps
some tensors at Q6_K), and a fallback type for tensors whose rows are not a multiple of the K-quant
block of 256 values. llama-cpp-python is optional: ``require_llama_cpp`` turns its absence into
one line before anything is written.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

import numpy as np

from hivetune.core.errors import UserError

# --quant type -> llama.cpp's file type constant
LLAMA_CPP_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
                    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
# Bits per weight no llama.cpp type above exceeds, fallbacks included (Q8_0: 8 bits + an f16 scale
# per 32 values): the disk estimate's bound for the quantized file.
MAX_BITS_PER_WEIGHT = 8.5
FALLBACK = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback quantization")
UNWEIGHED = re.compile(r"did not find weights for (\S+)")


def require_llama_cpp(option: str):
    """The llama_cpp module, or a one-line UserError that names the package to install."""
    try:
        import llama_cpp
    except ModuleNotFoundError:
        raise UserError(f"{option}: needs llama.cpp's quantizer from the llama-cpp-python package, "
                        f"which is not installed (pip install llama-cpp-python)") from None
    except Exception as e:  # an installed package whose shared library does not load
        raise UserError(f"{option}: llama-cpp-python is installed but does not load "
                        f"({type(e).__name__}: {e})") from None
    return llama_cpp


def imatrix_entries(llama_cpp, imatrix: dict[str, np.ndarray]):
    """llama.cpp's importance-matrix array ({name, data, size} per tensor, then a null name) over
    `imatrix` (model.imatrix); the arrays it points into are kept on it."""
    if not hasattr(llama_cpp, "llama_model_imatrix_data"):
        raise UserError("--imatrix: this llama-cpp-python's quantizer takes no importance matrix "
                        "(pip install -U llama-cpp-python)")
    entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
    entries.arrays = [np.ascontiguousarray(values, dtype=np.float32) for values in imatrix.values()]
    for entry, name, values in zip(entries, imatrix, entries.arrays):
        entry.name, entry.size = name.encode(), values.size
        entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    return entries


def quantize_gguf(source: Path, target: Path, quant: str, threads: int = 0,
                  imatrix: dict[str, np.ndarray] | None = None) -> str:
    """Quantize the (f16) GGUF `source` into `target` as `quant`, each tensor's rounding weighed by
    `imatrix` where given (model.imatrix). llama.cpp's log is captured rather than printed: its
    last line is the error on failure; returns its fallback count ("N of M tensors"), or "" when
    every tensor got the asked-for type."""
    llama_cpp = require_llama_cpp(f"--quant {quant}")
    from llama_cpp import _logger  # llama-cpp-python's own log callback, put back afterwards

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_CPP_QUANTS[quant])
    params.nthread = threads or os.cpu_count() or 1
    if imatrix:
        entries = imatrix_entries(llama_cpp, imatrix)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    lines: list[str] = []
    capture = llama_cpp.llama_log_callback(lambda level, text, data: lines.append(text.decode(errors="replace")))
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    log = "".join(lines).strip()
    if rc != 0:
        last = log.splitlines()[-1] if log else "no log"
        raise UserError(f"{source}: llama.cpp's quantizer failed for {quant} (return code {rc}): {last}")
    # every quantized tensor has its entry (model.imatrix) but an untied model's token embeddings
    unweighed = [name for name in UNWEIGHED.findall(log) if name != "token_embd.weight"] if imatrix else []
    if unweighed:
        print(f"hivetune: export: {quant}: no importance matrix entry for {', '.join(unweighed)}", file=sys.stderr)
    fallback = FALLBACK.search(log)
    return f"{fallback.group(1)} of {fallback.group(2)} tensors" if fallback else ""
