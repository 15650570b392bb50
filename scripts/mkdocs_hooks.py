"""MkDocs hook (mkdocs.yml): the benchmark results the docs cite are part of the site.

Every file under benchmarks/results/ is added as `results/...`, so docs/performance.md links
each figure and table to its own file, and `mkdocs build --strict` fails if one is missing.
"""

from __future__ import annotations

import os

from mkdocs.structure.files import File

RESULTS = os.path.join("benchmarks", "results")


def on_files(files, config):
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    src_dir = os.path.join(root, "benchmarks")
    for d, dirs, names in os.walk(os.path.join(root, RESULTS)):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(d, name), src_dir)
            files.append(File(rel, src_dir, config.site_dir, config.use_directory_urls))
    return files
