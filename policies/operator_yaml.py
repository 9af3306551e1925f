"""Reading the YAML files operators write (the policy file, the gateway config).

Two things plain `yaml.safe_load` allows are refused here, on the composed document before anything
is built from it:

- aliases that expand it past `MAX_YAML_NODES`: anchors and aliases may share values, but an alias
  repeats a value without repeating its bytes, so without the bound a few kilobytes could build
  gigabytes (the 1 MiB file-size limit bounds the expansion only with it);
- a key said twice in one mapping: YAML keeps the last one silently, so an edit to the first
  occurrence changes nothing, a trap on a file that is hot-reloaded.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

# Nodes a document may expand to, aliases counted at every use: about twice what a 1 MiB file
# can hold written out (a flow list of one-digit numbers, two bytes a node).
MAX_YAML_NODES = 1_000_000


class OperatorYamlError(yaml.YAMLError):
    """A YAML document that parses but is refused for its shape; the message says where."""


class YamlTooLarge(OperatorYamlError):
    """A YAML document whose aliases expand it past `MAX_YAML_NODES`, or refer to themselves."""


class DuplicateYamlKey(OperatorYamlError):
    """A mapping that names one key twice."""


class _OperatorLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that checks the composed document (`_expanded_size`,
    `_refuse_duplicate_keys`) before building anything from it."""

    def get_single_node(self) -> Node | None:
        node: Node | None = super().get_single_node()
        if node is not None:
            _expanded_size(node, MAX_YAML_NODES)
            _refuse_duplicate_keys(node)
        return node


def _expanded_size(root: Node, limit: int) -> int:
    """The nodes `root` stands for with every alias expanded where it is used; `YamlTooLarge`
    past `limit` or on an alias inside the value it names. Each node is measured once (a shared
    node's size is remembered), so this costs the composed graph's size, not the expansion's."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Node) -> int:
        key = id(node)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in open_nodes:
            raise YamlTooLarge("a YAML alias refers to the value that contains it")
        open_nodes.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        if total > limit:
            raise YamlTooLarge(
                f"the YAML document expands to more than {limit:,} values through its aliases; "
                "write shared values out or share fewer"
            )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _refuse_duplicate_keys(root: Node) -> None:
    """`DuplicateYamlKey` naming the first key said twice in one mapping, by its path from the top
    (`cost.epsilon`, `pools.0.name`) and both lines. Keys are compared as written with their
    resolved tag (`1` and `'1'` differ, as they do once built). Each node is visited once: a
    shared one is reported under the first path that reaches it. Runs after `_expanded_size`,
    which refuses an alias inside the value it names."""
    seen: set[int] = set()

    def visit(node: Node, path: tuple[str, ...]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                visit(item, (*path, str(i)))
        elif isinstance(node, MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if not isinstance(key, ScalarNode):  # a complex key: its value is still checked
                    visit(value, path)
                    continue
                line = key.start_mark.line + 1
                said = (key.tag, key.value)
                if said in first_line:
                    where = ".".join((*path, key.value))
                    raise DuplicateYamlKey(
                        f"duplicate key {where!r} on line {line} (first on line {first_line[said]}): "
                        "YAML keeps only the last, so an edit to the first would change nothing"
                    )
                first_line[said] = line
                visit(value, (*path, key.value))

    visit(root, ())


def load_operator_yaml(text: str) -> Any:
    """`yaml.safe_load` for operator files, refusing (`OperatorYamlError`) a document whose aliases
    expand it past `MAX_YAML_NODES` and a mapping with a key said twice."""
    loader = _OperatorLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        # PyYAML composes nested collections recursively.
        raise YamlTooLarge("the YAML document is nested too deeply") from None
    finally:
        loader.dispose()
