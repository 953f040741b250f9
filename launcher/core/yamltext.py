"""Values written as YAML (pure): the Kubeflow manifests' writer, without a YAML library."""

from __future__ import annotations

import re
from typing import Any

PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*\Z")
YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}  # YAML 1.1 booleans
ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def to_yaml(value: Any) -> str:
    """Block-style YAML of dicts, lists, strings, ints, bools and None, that any YAML 1.1 or
    1.2 reader (PyYAML, kubectl's) reads back as the same value."""
    return "\n".join(yaml_lines(value, 0)) + "\n"


def yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for key, item in value.items():
            head = f"{pad}{yaml_scalar(str(key))}:"
            if isinstance(item, dict | list) and item:
                lines += [head, *yaml_lines(item, indent + 2)]
            else:
                lines.append(f"{head} {yaml_scalar(item)}")
        return lines
    if isinstance(value, list) and value:
        lines = []
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = yaml_lines(item, indent + 2)
                lines += [f"{pad}- {inner[0][indent + 2 :]}", *inner[1:]]
            else:
                lines.append(f"{pad}- {yaml_scalar(item)}")
        return lines
    return [pad + yaml_scalar(value)]


def yaml_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if PLAIN.match(text) and text.lower() not in YAML_WORDS:
        return text
    return '"' + "".join(yaml_char(c) for c in text) + '"'


def yaml_char(char: str) -> str:
    """A character inside a double-quoted scalar: printable ones as they are (UTF-8), the
    rest escaped (line separators and the BOM too: YAML 1.1 readers break lines there)."""
    if char in ESCAPES:
        return ESCAPES[char]
    code = ord(char)
    printable = 0x20 <= code <= 0x7E or 0xA0 <= code <= 0xFFFD or code >= 0x10000
    if printable and char not in "\u2028\u2029\ufeff" and not 0xD800 <= code <= 0xDFFF:
        return char
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"
