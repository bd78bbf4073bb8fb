"""The unit stays C++17: torch >= 2.4 is supported, and torch 2.11's cpp_extension (the GPU
machine's) compiles it as C++17 while torch 2.14's passes -std=c++20, so a C++20 construct builds
on one machine and not on another (a requires-expression in the backward's launch did). This scans
csrc/ with comments and string literals removed for the C++20-only keywords, operators, headers
and attributes the unit could reach for."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "csrc").glob("*.[ch]*"))
CXX20_ONLY = {
    r"\brequires\b": "a requires-clause or requires-expression (use a std::void_t trait)",
    r"\bconcept\b": "a concept (use std::enable_if or a trait)",
    r"\bconsteval\b": "consteval (use constexpr)",
    r"\bconstinit\b": "constinit",
    r"\bco_(?:await|yield|return)\b": "a coroutine",
    r"<=>": "the three-way comparison",
    r"\bchar8_t\b": "char8_t",
    r"#\s*include\s*<(?:span|concepts|ranges|bit|compare|coroutine|format|numbers|source_location)>": "a C++20 header",
    r"\[\[(?:likely|unlikely|no_unique_address)\]\]": "a C++20 attribute",
    r"\bstd::(?:span|bit_cast|is_constant_evaluated|remove_cvref|to_address|ssize)\b": "a C++20 library name",
}
COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)


def cxx20_uses(text: str) -> list[str]:
    """'line N: what' for every C++20-only construct in C++ source `text`, comments and string
    literals left out (line numbers kept)."""
    code = COMMENT_OR_STRING.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    found = sorted(
        (code.count("\n", 0, match.start()) + 1, what)
        for pattern, what in CXX20_ONLY.items()
        for match in re.finditer(pattern, code)
    )
    return [f"line {line}: {what}" for line, what in found]


def test_the_scan_catches_cxx20_and_leaves_comments_alone():
    planted = (
        "template <typename T> void f() {\n"
        "  if constexpr (requires { T::kWs; }) {}\n"
        "}\n"
        "// a requires-expression would not do here; 'concept' in a comment is fine\n"
        'const char* s = "requires <=>";\n'
        "auto c = a <=> b;\n"
        "#include <span>\n"
    )
    assert cxx20_uses(planted) == [
        "line 2: a requires-clause or requires-expression (use a std::void_t trait)",
        "line 6: the three-way comparison",
        "line 7: a C++20 header",
    ]
    assert cxx20_uses("template <typename T, typename = std::void_t<decltype(T::kWs)>>\n") == []


def test_the_unit_is_cxx17():
    assert SOURCES, "no sources under csrc/"
    found = {
        path.name: uses
        for path in SOURCES
        if (uses := cxx20_uses(path.read_text(errors="replace")))
    }
    assert not found, (
        f"C++20 in the unit, which torch 2.11's build compiles as C++17: {found}; "
        "rewrite it in C++17"
    )
