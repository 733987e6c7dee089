"""Z-Image (Tongyi-MAI): one folder holds the adapter, its tiny flavor and its LoRA key layout."""
