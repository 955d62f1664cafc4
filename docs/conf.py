# Sphinx configuration of fullshard's documentation site (built by scripts/docs into
# build-docs/html): Markdown pages (MyST), the C++ and C reference from the public headers'
# comments (Doxygen XML through Breathe), the Fortran module's from Doxygen's own HTML.
import os
import re

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(_root, "CMakeLists.txt")) as f:
    release = re.search(r"project\(fullshard VERSION ([0-9.]+)", f.read()).group(1)

project = "fullshard"
copyright = "the fullshard authors"
version = release
extensions = ["myst_parser", "breathe"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["examples"]
myst_heading_anchors = 4
html_theme = "furo"
html_title = f"fullshard {release}"
# Doxygen's HTML of the Fortran module, copied beside the pages (scripts/docs makes it).
html_extra_path = [os.environ["FULLSHARD_DOCS_EXTRA"]] if os.environ.get("FULLSHARD_DOCS_EXTRA") else []
breathe_projects = {"fullshard": os.environ.get("FULLSHARD_DOXYGEN_XML", "")}
breathe_default_project = "fullshard"
breathe_domain_by_extension = {"h": "c"}
