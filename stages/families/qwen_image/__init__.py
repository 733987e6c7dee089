"""The qwen_image family (Qwen-Image): everything about it that is not pure data (its schemas/families.py row)."""
