"""The demo's family: SD1.5's architecture at a size that trains in seconds on a CPU.

Only the facts (16-token captions) and the tiny configs differ from sd15; every behaviour is SD15Family's.
"""
from __future__ import annotations

from typing import ClassVar

from schemas.families import FAMILY_FACTS, FamilyFacts
from stages.families.sd15 import SD15Family


class TinyFamily(SD15Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["tiny"]
    # Demo captions are a handful of words; 16 positions keep text caches and cross-attention small.
    tiny_text_length: ClassVar[int] = FAMILY_FACTS["tiny"].max_length
