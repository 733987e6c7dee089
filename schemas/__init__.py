"""The project's vocabulary: every config section and every artifact manifest (pydantic v2)."""
