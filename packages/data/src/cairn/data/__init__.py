"""cairn.data: deterministic, checkpointable input pipelines."""

__all__: list[str] = []

# --- sources (data-sources helper) ---
# --- end sources ---
