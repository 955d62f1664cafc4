#!/usr/bin/env python3
"""Checks an install tree's public headers: none is a private one (a `detail` directory), and
every fullshard header an installed header includes was installed too.

Usage: check_headers.py PREFIX   (the prefix `cmake --install` wrote)
"""
import os
import re
import sys

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"](fullshard/[^">]+)[">]')


def main(prefix):
    top = os.path.join(prefix, "include")
    root = os.path.join(top, "fullshard")
    if not os.path.isdir(root):
        sys.exit(f"check_headers: no {root} (was the tree installed?)")
    problems, count = [], 0
    for d, _, files in os.walk(root):
        for f in sorted(files):
            path = os.path.join(d, f)
            rel = os.path.relpath(path, top)
            count += 1
            if "detail" in rel.split(os.sep):
                problems.append(f"{rel}: a private header was installed")
            if not f.endswith((".hpp", ".h")):
                continue
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    m = INCLUDE_RE.match(line)
                    if m and not os.path.isfile(os.path.join(top, m.group(1))):
                        problems.append(f"{rel}:{n}: includes {m.group(1)}, which is not installed")
    for p in problems:
        print(p)
    if problems:
        sys.exit(f"check_headers: {len(problems)} problem(s) in {count} installed files")
    print(f"check_headers: {count} installed files, no private header, every include present")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
