"""hivetune: fast, lean, hard-to-break LoRA fine-tuning for Llama-family decoders."""

import os

# Packed rows change length every step; without expandable segments the CUDA caching allocator
# fragments and reserves ~4x what is allocated (W1 on an H200: 32.6 GiB reserved for 8.0 GiB
# allocated). Set before torch touches CUDA; a user's own setting wins.
OWN_ALLOC_CONF = "expandable_segments:True"
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = OWN_ALLOC_CONF
    os.environ["HIVETUNE_OWN_ALLOC_CONF"] = "1"  # torchrun's workers inherit both
# Whether the setting is hivetune's own (distributed.fixed_segments changes only ours).
ALLOC_CONF_IS_OURS = (os.environ.get("HIVETUNE_OWN_ALLOC_CONF") == "1"
                      and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == OWN_ALLOC_CONF)

__version__ = "0.1.0"
