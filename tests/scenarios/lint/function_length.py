#!/usr/bin/env python3
"""No function over 80 lines in the product's code: bench/, examples/, src/, python/ (the
extension's csrc and the package) and tools/. Prints each offender as path:line name (lines)
and exits 1 if there is any.

    function_length.py [REPO_ROOT] [--max 80]

C++ functions are found by their braces: a '{' outside any function whose header (the text
since the previous ';', '{' or '}') ends in a parameter list, optionally followed by qualifiers
or a constructor's initializer list, opens one; lambdas and nested blocks count toward the
function around them. Python functions come from the ast.
"""

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOTS = ("bench", "examples", "src", "python", "tools")
CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|do|else|try)\b")
NOT_FUNCTION = re.compile(r"^\s*(namespace|class|struct|enum|union|extern)\b|=\s*$|\[[^\]]*\]\s*\(.*\)\s*[^)]*$")
SIGNATURE_END = re.compile(r"\)\s*(const\b|override\b|final\b|noexcept\b|mutable\b|->[^;{}]*|:\s*[^;{}]*|\s)*$", re.S)


def strip(text: str) -> str:
    """Comments and string/char literals blanked out, newlines kept (so line numbers hold)."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|R"([^(]*)\(.*?\)\1"|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def cpp_functions(text: str):
    code = strip(text)
    depth, start, header_from, function_depth, name = 0, 0, 0, None, ""
    for i, c in enumerate(code):
        if c == "{":
            if function_depth is None:
                header = code[header_from:i]
                if SIGNATURE_END.search(header) and not CONTROL.match(header) and not NOT_FUNCTION.search(header):
                    function_depth, start = depth, code.count("\n", 0, i) + 1
                    name = " ".join(header.split("(")[0].split()[-1:])
            depth += 1
            header_from = i + 1
        elif c == "}":
            depth -= 1
            header_from = i + 1
            if function_depth is not None and depth == function_depth:
                end = code.count("\n", 0, i) + 1
                yield name, start, end - start + 1
                function_depth = None
        elif c == ";":
            header_from = i + 1


def python_functions(text: str):
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=".")
    parser.add_argument("--max", type=int, default=80)
    args = parser.parse_args()
    root = Path(args.root)
    files = subprocess.run(["git", "-C", str(root), "ls-files", *ROOTS], check=True, capture_output=True,
                           text=True).stdout.split()
    offenders = []
    for f in files:
        path = root / f
        if path.suffix in (".cpp", ".h"):
            functions = cpp_functions(path.read_text())
        elif path.suffix == ".py":
            functions = python_functions(path.read_text())
        else:
            continue
        offenders += [f"{f}:{line} {name} ({n} lines)" for name, line, n in functions if n > args.max]
    for o in offenders:
        print(o)
    print(f"function_length: {len(offenders)} function(s) over {args.max} lines in {', '.join(ROOTS)}")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
