"""rlbench: a notebook-first workbench for RL post-training of language models."""
