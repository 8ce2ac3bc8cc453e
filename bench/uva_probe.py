"""Can a Triton kernel gather rows straight from pinned host memory (UVA), and how fast?

    python bench/uva_probe.py   # prints ok / the error, and the gather's time for W2's shape

W2's frozen input embedding (152,064 x 3,584 bf16, 1.02 GiB) could then stay in host memory:
a micro-batch reads ~3,000 rows (~21 MB) over PCIe.
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _gather(TABLE, IDS, OUT, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.load(IDS + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        m = c + cols < D
        tl.store(OUT + row.to(tl.int64) * D + c + cols, tl.load(TABLE + idx * D + c + cols, mask=m), mask=m)


def main():
    vocab, d, tokens = 152064, 3584, 3000
    table = torch.randn(vocab, d, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, vocab, (tokens,), device="cuda")
    out = torch.empty(tokens, d, dtype=torch.bfloat16, device="cuda")
    try:
        _gather[(tokens,)](table, ids, out, d, BLOCK=1024)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"uva gather: failed: {type(e).__name__}: {str(e)[:300]}")
        return
    want = table[ids.cpu()].cuda()
    print(f"uva gather: ok, equal={torch.equal(out, want)}")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            _gather[(tokens,)](table, ids, out, d, BLOCK=1024)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 20 * 1000
        print(f"uva gather of {tokens} rows x {d}: {ms:.3f} ms ({tokens * d * 2 / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
