"""Reading a config file's YAML so that what a user wrote is what gets validated, and a hostile file costs nothing.

PyYAML's safe_load alone lets three things through that only fail (or silently differ) later:
- a key written twice in one mapping (two `train:` sections, or `steps:` twice): the last one silently wins;
- aliases that expand exponentially ("billion laughs"): a 3 KB file loads as shared references, then every
  consumer that walks or serializes it (validation, JSON for Prefect) expands it and runs out of memory;
- `.inf` / `.nan` inside free-form mappings (ops.remote_options) that no typed field refuses.
Each is refused here naming the key path and line.
"""

from __future__ import annotations

import math

import yaml

# Nodes a config may expand to once aliases are followed: a generous config (hundreds of prompts, sources) has a few
# thousand; a bomb has billions.
MAX_NODES = 100_000


class YamlProblem(ValueError):
    """What is wrong with the file, naming where."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key written twice."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader's own error for an unhashable key follows
            if key in seen:
                raise YamlProblem(
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); YAML would silently keep only the last: "
                    f"merge them into one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expanded_sizes(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many nodes `node` stands for with every alias expanded (an alias is the same node object reused)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once; SafeLoader builds such cycles without expanding them
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_sizes(k, memo) + _expanded_sizes(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_sizes(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def _largest_path(node: yaml.Node, memo: dict[int, int], path: str = "") -> str:
    """The deepest key path still holding most of the expansion: where to look in the file."""
    children: list[tuple[str, yaml.Node]] = []
    if isinstance(node, yaml.MappingNode):
        children = [(f"{path}.{k.value}" if path else str(k.value), v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node.value)]
    if not children:
        return path or "(top level)"
    name, child = max(children, key=lambda c: memo.get(id(c[1]), 1))
    if memo.get(id(child), 1) * 2 < memo.get(id(node), 1):
        return path or "(top level)"  # no single child holds most of it: the expansion is spread here
    return _largest_path(child, memo, name)


def _non_finite(value, path: str = "", seen: set[int] | None = None) -> str | None:
    """The key path of the first infinity or NaN in loaded data, None when there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(top level)"
    seen = set() if seen is None else seen
    if id(value) in seen:
        return None  # an alias already walked (or a recursive one)
    seen.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}" if path else str(key), seen)
        if found:
            return found
    return None


def load_yaml(text: str):
    """The file's data, or YamlProblem naming the key path (and line) of what is refused."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        memo: dict[int, int] = {}
        if _expanded_sizes(node, memo) > MAX_NODES:
            raise YamlProblem(
                f"{_largest_path(node, memo)}: its aliases expand to more than {MAX_NODES:,} values "
                f"(an alias bomb, or a config far larger than any real one); write the values out"
            )
        data = loader.construct_document(node)
    except RecursionError:
        raise YamlProblem("nested deeper than Python can read; a config is a few levels deep") from None
    finally:
        loader.dispose()
    where = _non_finite(data)
    if where:
        raise YamlProblem(f"{where}: infinity or NaN is not a usable value; write a finite number")
    return data
