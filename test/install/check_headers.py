#!/usr/bin/env python3
"""Checks an install tree's public headers: none is a private one (a `detail` directory),
every fullshard header an installed header includes was installed too, and no installed header
declares or names a `detail` namespace, and none includes nlohmann/json (JSON enters and leaves
through functions taking or returning a path or a text).

Usage: check_headers.py PREFIX [README]   (the prefix `cmake --install` wrote; with README,
       its "installs N headers with every component" must match when every component was
       installed)
"""
import os
import re
import sys

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"](fullshard/[^">]+)[">]')
DETAIL_RE = re.compile(r"\bnamespace\s+(\w+::)*detail\b|\bdetail::")
JSON_RE = re.compile(r'^\s*#\s*include\s*[<"]nlohmann/')


README_COUNT_RE = re.compile(r"installs (\d+) headers with every component")


def main(prefix, readme=None):
    top = os.path.join(prefix, "include")
    root = os.path.join(top, "fullshard")
    if not os.path.isdir(root):
        sys.exit(f"check_headers: no {root} (was the tree installed?)")
    problems, count, headers = [], 0, 0
    for d, _, files in os.walk(root):
        for f in sorted(files):
            path = os.path.join(d, f)
            rel = os.path.relpath(path, top)
            count += 1
            if "detail" in rel.split(os.sep):
                problems.append(f"{rel}: a private header was installed")
            if not f.endswith((".hpp", ".h")):
                continue
            headers += 1
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    code = line.split("//", 1)[0]
                    if DETAIL_RE.search(code):
                        problems.append(f"{rel}:{n}: names a detail namespace: {line.strip()}")
                    if JSON_RE.match(code):
                        problems.append(f"{rel}:{n}: includes nlohmann/json")
                    m = INCLUDE_RE.match(line)
                    if m and not os.path.isfile(os.path.join(top, m.group(1))):
                        problems.append(f"{rel}:{n}: includes {m.group(1)}, which is not installed")
    # A listed header that is installed and no longer needs its entry: delete the entry.
    every = all(
        os.path.isfile(os.path.join(root, h)) for h in ("torch.hpp", "fullshard.h")
    ) and os.path.isdir(os.path.join(root, "fortran"))
    if readme and every:
        with open(readme, encoding="utf-8") as fh:
            m = README_COUNT_RE.search(fh.read().replace("\n", " "))
        if not m:
            problems.append(f"{readme}: no 'installs N headers with every component'")
        elif int(m.group(1)) != headers:
            problems.append(
                f"{readme}: says {m.group(1)} installed headers, the tree has {headers}"
            )
    for p in problems:
        print(p)
    if problems:
        sys.exit(f"check_headers: {len(problems)} problem(s) in {count} installed files")
    print(
        f"check_headers: {count} installed files ({headers} headers), no private header, every "
        f"include present, no detail namespace, no nlohmann/json"
    )


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
