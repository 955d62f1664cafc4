#!/usr/bin/env python3
"""Lint and cross-check the Spack recipe of fullshard.

Usage: python3 check_recipe.py <repo-root>

Checks, each reported on its own line:
  flake8      the recipe passes flake8 with Spack's builtin-repo settings
  black       the recipe is formatted with black -l 99
  cmake-vars  every CMake variable the recipe passes to define()/define_from_variant()
              is a standard CMake variable or an option()/cache variable of the project
  variants    every declared variant is used by cmake_args() or by a when=/conflicts
              condition, so that no variant silently does nothing
  self-reference  no depends_on("X", when="... ^X ...") (spack audit rejects it)
  repo.yaml   the Spack repository is API v1 with namespace "fullshard"

Exits non-zero, naming the failed checks, if any check fails. Needs only the
Python standard library plus the flake8 and black tools (see scripts/setup).
"""

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

RECIPE = Path("spack", "packages", "fullshard", "package.py")
REPO_YAML = Path("spack", "repo.yaml")
NAMESPACE = "fullshard"
FLAKE8_ARGS = ["--max-line-length", "99", "--extend-ignore", "E731,E203,W503,F403,F405,F821"]
BLACK_ARGS = ["-l", "99", "--check", "--diff"]
SETUP_HINT = "run scripts/setup to install the Python lint tools (flake8, black)"

# CMake commands that declare a user-settable cache variable.
CMAKE_OPTION_RE = re.compile(
    r"\b(?:option|cmake_dependent_option)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)"
    r"|\bset\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s[^)]*?\bCACHE\b",
    re.IGNORECASE,
)
VARIANT_TOKEN_RE = re.compile(r"[+~]([A-Za-z_][\w-]*)|([A-Za-z_][\w-]*)==?")


class Failure(Exception):
    """A check failed; the message says why."""


def tool_command(name):
    """Command prefix for a Python lint tool, from PATH or the running interpreter."""
    exe = shutil.which(name)
    if exe:
        return [exe]
    if importlib.util.find_spec(name) is not None:
        return [sys.executable, "-m", name]
    raise Failure(f"{name} not found; {SETUP_HINT}")


def run_tool(name, args, path):
    cmd = tool_command(name) + args + [str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise Failure(f"{name} reported problems:\n{output}")


def check_flake8(root):
    run_tool("flake8", FLAKE8_ARGS, root / RECIPE)
    return "clean"


def check_black(root):
    run_tool("black", BLACK_ARGS, root / RECIPE)
    return "formatted"


def call_name(node):
    """Name of the called function: 'f' for f(...), 'define' for self.define(...)."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def string_value(node):
    """Text of a string literal; f-string placeholders become '{}'. None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                parts.append("{}")
        return "".join(parts)
    return None


def calls(tree, *names):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and call_name(node) in names:
            yield node


def parse_recipe(root):
    path = root / RECIPE
    if not path.is_file():
        raise Failure(f"recipe not found: {path}")
    return ast.parse(path.read_text(), filename=str(path))


def cmake_options(root):
    """Names declared by option(), cmake_dependent_option() and set(... CACHE ...)."""
    if not (root / "CMakeLists.txt").is_file():
        raise Failure(f"no CMakeLists.txt in {root}")
    files = [root / "CMakeLists.txt"]
    cmake_dir = root / "cmake"
    if cmake_dir.is_dir():
        files += sorted(cmake_dir.rglob("*.cmake"))
    names = set()
    for path in files:
        if not path.is_file():
            continue
        text = re.sub(r"#[^\n]*", "", path.read_text())
        for match in CMAKE_OPTION_RE.finditer(text):
            names.add(match.group(1) or match.group(2))
    return names


def is_standard_cmake_variable(name):
    return name.startswith("CMAKE_") or name == "BUILD_SHARED_LIBS"


def check_cmake_vars(root):
    tree = parse_recipe(root)
    options = cmake_options(root)
    used, problems = [], []
    for node in calls(tree, "define", "define_from_variant"):
        name = string_value(node.args[0]) if node.args else None
        if name is None or "{}" in name:
            problems.append(f"line {node.lineno}: {call_name(node)}() needs a literal name")
            continue
        used.append(name)
        if not is_standard_cmake_variable(name) and name not in options:
            problems.append(
                f"line {node.lineno}: {name} is not an option()/cache variable"
                " of CMakeLists.txt or cmake/*.cmake"
            )
    if not used:
        problems.append("the recipe passes no CMake variables")
    if problems:
        raise Failure("\n".join(problems))
    return ", ".join(sorted(set(used)))


def root_spec_variants(spec):
    """Variant names a spec string constrains on the package itself (not on ^deps)."""
    spec = re.split(r"[\^%]", spec, maxsplit=1)[0]
    return {a or b for a, b in VARIANT_TOKEN_RE.findall(spec)}


def check_variants(root):
    tree = parse_recipe(root)
    declared = {}
    for node in calls(tree, "variant"):
        name = string_value(node.args[0]) if node.args else None
        if name is not None:
            declared[name] = node.lineno
    if not declared:
        raise Failure("the recipe declares no variants")

    used = set()
    for node in calls(tree, "define_from_variant"):
        names = [string_value(arg) for arg in node.args[:2]]
        if len(names) == 2 and names[1] is not None:
            used.add(names[1])
        elif names and names[0] is not None:
            used.add(names[0].lower())
    conditions = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        conditions += [kw.value for kw in node.keywords if kw.arg == "when"]
        if call_name(node) in ("conflicts", "when"):
            conditions += node.args[:1]
    for cond in conditions:
        spec = string_value(cond)
        if spec is not None:
            used |= root_spec_variants(spec)

    unused = sorted(name for name in declared if name not in used)
    if unused:
        raise Failure(
            "\n".join(
                f"line {declared[name]}: variant '{name}' is used neither in cmake_args()"
                " nor in a when=/conflicts condition"
                for name in unused
            )
        )
    return ", ".join(sorted(declared))


DEP_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][\w.-]*)")


def check_self_reference(root):
    """No depends_on("X...", when="... ^X ..."): spack audit rejects a dependency whose
    condition constrains that same dependency (it is self-referential); such a condition
    belongs in requires("^X...", when=...)."""
    tree = parse_recipe(root)
    problems, count = [], 0
    for node in calls(tree, "depends_on"):
        dep = string_value(node.args[0]) if node.args else None
        match = DEP_NAME_RE.match(dep or "")
        if match is None:
            continue
        count += 1
        name = match.group(1)
        for kw in node.keywords:
            when = string_value(kw.value) if kw.arg == "when" else None
            if when and re.search(r"\^\s*(\[[^\]]*\]\s*)?" + re.escape(name) + r"\b", when):
                problems.append(
                    f"line {node.lineno}: depends_on({dep!r}, when={when!r}) is self-referential"
                    f" (spack audit fails); use requires('^{dep}', when=...)"
                )
    if problems:
        raise Failure("\n".join(problems))
    return f"{count} depends_on, none conditioned on its own dependency"


def check_repo_yaml(root):
    path = root / REPO_YAML
    if not path.is_file():
        raise Failure(f"not found: {path}")
    problems = []
    namespace = None
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].rstrip()
        match = re.match(r"\s*(\w+)\s*:\s*(.*)$", line)
        if not match:
            continue
        key, value = match.group(1), match.group(2).strip().strip("'\"")
        if key == "api":
            problems.append("has an 'api:' key; the recipe needs an API v1 repository")
        elif key == "namespace":
            namespace = value
    if namespace != NAMESPACE:
        problems.append(f"namespace is {namespace!r}, expected {NAMESPACE!r}")
    if problems:
        raise Failure("\n".join(problems))
    return f"namespace {namespace}, API v1"


CHECKS = [
    ("flake8", check_flake8),
    ("black", check_black),
    ("cmake-vars", check_cmake_vars),
    ("variants", check_variants),
    ("self-reference", check_self_reference),
    ("repo.yaml", check_repo_yaml),
]


def main(argv):
    if len(argv) != 2:
        print(f"usage: {argv[0]} <repo-root>", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    failed = []
    for name, check in CHECKS:
        try:
            detail = check(root)
        except (Failure, OSError, SyntaxError) as err:
            failed.append(name)
            lines = str(err).splitlines() or [""]
            print(f"FAIL {name}: {lines[0]}")
            for line in lines[1:]:
                print(f"     {line}")
        else:
            print(f"ok   {name}: {detail}")
    if failed:
        print(f"spack recipe check FAILED: {', '.join(failed)}")
        return 1
    print("spack recipe check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
