"""The qwen_image_edit_plus family (Qwen-Image-Edit Plus, 2509): everything about it that is not pure data (its
schemas/families.py row)."""
