"""A CPU stand-in for the ring-flash-attn package (see llama3_flash_attn_varlen.py beside this file).

The real package's __init__ imports its HF adapter, which fails under transformers 5 (it imports
`is_flash_attn_greater_or_equal_2_10` from transformers.modeling_flash_attention_utils); this one fails the same
way, so a test passes only if rlbench loads the kernel module without running the package's __init__.
"""

raise ImportError("ring_flash_attn stand-in: the package __init__ (HF adapter) is not importable, as with the real "
                  "package under transformers 5")
