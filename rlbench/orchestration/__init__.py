"""How the parts are put together: `local` (one process, trainer and engine colocated)."""
