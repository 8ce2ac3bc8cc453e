"""Can a Triton kernel gather rows straight from pinned host memory (UVA), and how fast?

    python bench/uva_probe.py   # prints ok / the error, and the gather's time for W2's shape

Times hivetune's own gather (ops.host_embedding.HostEmbedding, train's host_embeddings) on W2's
frozen input embedding (152,064 x 3,584 bf16, 1.02 GiB in host memory): a micro-batch reads
~3,000 rows (~21 MB) over PCIe. (Its 0.44 ms / 49 GB/s figure in bench/results came from this
script's own copy of the kernel, before the shipped one replaced it; the kernels are the same.)
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.ops.host_embedding import HostEmbedding  # noqa: E402


def main():
    vocab, d, tokens = 152064, 3584, 3000
    embed = HostEmbedding(torch.randn(vocab, d, dtype=torch.bfloat16))
    ids = torch.randint(0, vocab, (tokens,), device="cuda")
    try:
        out = embed(ids)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"uva gather: failed: {type(e).__name__}: {str(e)[:300]}")
        return
    want = embed.weight[ids.cpu()].cuda()
    print(f"uva gather: ok, equal={torch.equal(out, want)}")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            embed(ids)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 20 * 1000
        print(f"uva gather of {tokens} rows x {d}: {ms:.3f} ms ({tokens * d * 2 / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
