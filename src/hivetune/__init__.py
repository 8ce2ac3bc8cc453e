"""hivetune: fast, lean, hard-to-break LoRA fine-tuning for Llama-family decoders."""

import os

# Packed rows change length every step; without expandable segments the CUDA caching allocator
# fragments and reserves ~4x what is allocated (W1 on an H200: 32.6 GiB reserved for 8.0 GiB
# allocated). Set before torch touches CUDA; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

__version__ = "0.1.0"
