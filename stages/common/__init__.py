"""Machinery every stage shares: the artifact store, fingerprints, the stage runner, sizes."""
