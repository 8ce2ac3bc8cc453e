"""Where the GPU sits against the host's NUMA nodes, and what that costs an offloading step.

    python bench/numa_probe.py [--out DIR] [--gib 1]

W2 under a 24 GiB cap moves ~3 GB a step over PCIe (activation_offload) and its eager step waits
on the host's kernel launches; the same commit and settings ran 10,138 and 13,687 tokens/s on one
machine (session 19). One suspect: the host memory or the thread on the NUMA node away from the
GPU. This probe reports the GPU's node (sysfs), the nodes this process may run on, and for each
pair (memory node, thread node) the pinned copy bandwidth each way (host memory first-touched by a
thread bound to the memory node, then registered with cudaHostRegister), and for each thread node
the host microseconds of a small kernel launch (bench.launch_us, as in every result's host
probe). Writes numa-probe-<commit>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import environment, launch_us  # noqa: E402


def cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def nodes() -> dict[int, set[int]]:
    """NUMA node -> the CPUs of it this process may run on (nodes with none left out)."""
    allowed = os.sched_getaffinity(0)
    found = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = cpulist((path / "cpulist").read_text()) & allowed
        if cpus:
            found[int(path.name[4:])] = cpus
    return found or {0: set(allowed)}


def gpu_node() -> tuple[str, int | None]:
    """The GPU's PCI address and NUMA node (None where sysfs does not say)."""
    bus = subprocess.check_output(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                                  text=True).strip()
    address = bus[-12:].lower()  # 00000000:19:00.0 -> 0000:19:00.0
    try:
        node = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text())
    except OSError:
        node = None
    return address, node


def host_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of host memory touched by this thread (first touch places the pages on its node),
    registered with CUDA so copies from and to it are DMA like pinned memory."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # one intra-op thread: set_num_threads(1) in main
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister: {rc}")
    return t


def bandwidth(host: torch.Tensor, gpu: torch.Tensor, to_gpu: bool, reps: int = 5) -> float:
    """GB/s of the best of `reps` copies of the whole buffer (CUDA events)."""
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        (gpu.copy_(host, non_blocking=True) if to_gpu else host.copy_(gpu, non_blocking=True))
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return round(host.numel() / best / 1e9, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--gib", type=float, default=1.0)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = int(opts.gib * 2**30)
    address, node = gpu_node()
    found = nodes()
    print(f"GPU {address} on NUMA node {node}; this process may run on nodes "
          + ", ".join(f"{n} ({len(c)} CPUs)" for n, c in found.items()))
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    start = os.sched_getaffinity(0)
    copies, launches = [], {}
    for mem in found:
        os.sched_setaffinity(0, found[mem])
        host = host_buffer(nbytes)
        for thread in found:
            os.sched_setaffinity(0, found[thread])
            row = {"memory_node": mem, "thread_node": thread, "h2d_gbs": bandwidth(host, gpu, True),
                   "d2h_gbs": bandwidth(host, gpu, False)}
            copies.append(row)
            print(f"memory on node {mem}, thread on node {thread}: H2D {row['h2d_gbs']} GB/s, "
                  f"D2H {row['d2h_gbs']} GB/s")
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host
    for thread in found:
        os.sched_setaffinity(0, found[thread])
        launches[thread] = launch_us(torch.device("cuda"))
        print(f"thread on node {thread}: {launches[thread]} us a launch")
    os.sched_setaffinity(0, start)
    try:
        topo = subprocess.check_output(["nvidia-smi", "topo", "-m"], text=True)
    except Exception as e:  # noqa: BLE001
        topo = f"unavailable: {e}"
    try:
        cpu = subprocess.check_output(["lscpu"], text=True)
    except Exception as e:  # noqa: BLE001
        cpu = f"unavailable: {e}"
    record = {"environment": environment(torch.device("cuda")), "gpu_pci": address, "gpu_numa_node": node,
              "nodes": {n: sorted(c) for n, c in found.items()}, "copy_gib": opts.gib, "copies": copies,
              "launch_us_by_thread_node": launches, "nvidia_smi_topo": topo, "lscpu": cpu}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"numa-probe-{record['environment']['commit'][:7]}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
