"""The tiny family: everything about it that is not pure data (that is its row in schemas/families.py)."""
