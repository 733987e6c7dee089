"""The qwen_image_edit family (Qwen-Image-Edit): everything about it that is not pure data (its schemas/families.py row)."""
